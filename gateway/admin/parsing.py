"""What the admin API reads of a request: its JSON body and query parameters, each checked, a
400 naming the field at fault (changes.Invalid) otherwise."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, overload

import orjson
from aiohttp import web

from gateway.admin import changes
from gateway.config import MAX_PER_MINUTE, usd
from middlewares.core.periods import PERIODS

MAX_PAGE = 1000  # rows a page may hold
DEFAULT_PAGE = 100
MAX_CONCURRENT = 2**31 - 1  # the stores keep it as a 32-bit integer


async def body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise changes.Invalid("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise changes.Invalid("the body must be a JSON object")
    return body


def known(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    unknown = [name for name in body if name not in fields]
    if unknown:
        raise changes.Invalid(f"{unknown[0]}: unknown field (expected {', '.join(fields)})")


KEY_FIELDS = (
    "name",
    "models",
    "spend_limit_usd",
    "budget_period",
    "rpm",
    "tpm",
    "max_concurrent",
    "expires_at",
    "organization",
)


def key_fields(body: dict[str, Any], *, creating: bool) -> dict[str, Any]:
    """The key's settings in `body`, as changes.create_key and update_key take them
    (a PATCH may also set `revoked`; null, and 0 for the counts, remove a limit)."""
    known(body, KEY_FIELDS if creating else (*KEY_FIELDS, "revoked"))
    if creating and not isinstance(body.get("name"), str):
        raise changes.Invalid("name: required, a string")
    fields: dict[str, Any] = {}
    for name, value in body.items():
        if name == "name":
            if not isinstance(value, str):
                raise changes.Invalid("name: expected a string")
            fields["name"] = value
        elif name == "models":
            if not isinstance(value, list) or not value or not all(isinstance(m, str) and m for m in value):
                raise changes.Invalid('models: expected a non-empty list of model id globs, e.g. ["anthropic/*"]')
            fields["models"] = tuple(value)
        elif name == "spend_limit_usd":
            fields["spend_limit_usd"] = money(value, name)
        elif name == "budget_period":
            if value is not None and value not in PERIODS:
                raise changes.Invalid('budget_period: expected "day", "week", "month" or null (the key\'s whole life)')
            fields["budget_period"] = value
        elif name in ("rpm", "tpm", "max_concurrent"):
            fields[name] = count(value, name, MAX_PER_MINUTE if name != "max_concurrent" else MAX_CONCURRENT)
        elif name == "expires_at":
            fields["expires_at"] = None if value is None else moment(value, name)
        elif name == "organization":
            if not isinstance(value, str) or not value:
                raise changes.Invalid("organization: expected an organization's name")
            fields["organization"] = value
        elif name == "revoked":
            fields["revoked"] = boolean(value, name)
    return fields


def money(value: Any, name: str) -> Decimal | None:
    """An amount of USD, as a JSON number or a plain decimal string; null: none."""
    if value is None:
        return None
    if not isinstance(value, (int, float, str)) or isinstance(value, bool):
        raise changes.Invalid(f"{name}: expected an amount of USD (a number or a string), or null")
    # A JSON number is a number whatever its notation: written out in plain digits (1e-7 as
    # 0.0000001), as the string an amount must be.
    text = value if isinstance(value, str) else f"{Decimal(str(value)):f}"
    try:
        return usd(text)
    except ValueError as problem:
        raise changes.Invalid(f"{name}: {problem}") from None


def count(value: Any, name: str, most: int) -> int | None:
    if value is None or value == 0 and type(value) is int:
        return None
    if type(value) is not int or not 0 < value <= most:
        raise changes.Invalid(f"{name}: expected a whole number from 0 (no limit) to {most}, or null")
    return value


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise changes.Invalid(f"{name}: expected true or false")
    return value


def moment(value: Any, name: str) -> datetime:
    """An ISO date or datetime; UTC unless it has an offset."""
    try:
        moment = datetime.fromisoformat(value)
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except (ValueError, OverflowError, TypeError):  # not ISO; past year 1 or 9999 in UTC; not a string
        raise changes.Invalid(f"{name}: expected an ISO datetime such as 2030-01-31T12:00:00Z") from None


def moment_param(query, name: str) -> datetime | None:
    return None if name not in query else moment(query[name], name)


@overload
def int_param(query: Any, name: str, low: int, high: int, *, default: int) -> int: ...
@overload
def int_param(query: Any, name: str, low: int, high: int, *, default: None = None) -> int | None: ...
def int_param(query: Any, name: str, low: int, high: int, *, default: int | None = None) -> int | None:
    if name not in query:
        return default
    text = query[name]
    if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
        raise changes.Invalid(f"{name}: expected a whole number from {low} to {high}")
    return int(text)


def page(query) -> tuple[int, int]:
    """(limit, after): a page's size, and the cursor (`next` of the page before; an id)."""
    return (
        int_param(query, "limit", 1, MAX_PAGE, default=DEFAULT_PAGE),
        int_param(query, "after", 0, 2**63 - 1, default=0),
    )


def flag(query, name: str) -> bool | None:
    if name not in query:
        return None
    value = query[name].lower()
    if value not in ("true", "false"):
        raise changes.Invalid(f"{name}: expected true or false")
    return value == "true"
