"""The admin API, `/admin/v1/…`: keys, organizations, people, usage, the ledger and the audit log,
as JSON, for scripts, CI jobs and Terraform (docs/admin.md).

On only when the config has an `[admin]` table. Its routes are not the API's: no chain of stages,
no billing. A request is authenticated by an admin token (`Authorization: Bearer …`), never by a
gateway key: the config's tokens by digest, compared in constant time, and the store's, looked up
by digest on every request (so a revoked token is refused from its next request on). A `viewer`
reads; an `admin` also writes. Failed attempts are counted per client address, with the
console's: past `failed_attempts_per_minute`, a wrong token from it gets 429 for the rest of the
minute, and the right one is still accepted.

Every change goes through gateway/admin/changes.py, as the CLI's do, which audits it; people, whom
the CLI does not change, are disabled and enabled here, audited the same way. Tokens are
looked up by gateway/admin/tokens.py (as the console's are), and bodies and query parameters read
by gateway/admin/parsing.py."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from typing import Any

import orjson
from aiohttp import web

from gateway.accounting.money import usd_exact
from gateway.accounting.usage import USAGE_GROUPS, usage_csv, usage_for
from gateway.admin import changes, parsing
from gateway.admin.changes import AdminError
from gateway.admin.openapi import OPENAPI
from gateway.admin.tokens import AdminTokens, Holder, Refused, admin_tokens
from gateway.clock import Clock, system
from gateway.config import AdminConfig, is_id
from gateway.storage import KeyRecord, OrganizationRecord, PersonRecord, Store
from gateway.storage.records import key_view, organization_view, person_view
from middlewares.core.credentials import bearer_token
from middlewares.core.errors import GatewayError

PREFIX = "/admin/v1"


class AdminAuth:
    """Who a request is, by its admin token (gateway/admin/tokens.py counts the failures)."""

    def __init__(self, tokens: AdminTokens) -> None:
        self._tokens = tokens

    async def caller(self, request: web.Request) -> Holder:
        token = bearer_token(request)  # never x-api-key: that header is for gateway keys
        if token is None:  # guesses nothing, so counts as no failure
            raise _error(
                401, "Missing admin token: send it as `Authorization: Bearer <token>`.", "authentication_error"
            )
        found = await self._tokens.check(token, request.remote or "")
        if not isinstance(found, Refused):
            return found
        if found.wait:
            raise _error(
                429,
                f"Too many failed admin sign-ins from this address: try again in {found.wait} s.",
                "rate_limit_error",
                headers={"retry-after": str(found.wait)},
            )
        raise _error(401, "Invalid admin token (gateway keys are not admin tokens).", "authentication_error")


def _error(status: int, message: str, type: str, *, headers: dict[str, str] | None = None) -> GatewayError:
    return GatewayError(status, message, type=type, headers=headers)


def add_admin_routes(
    app: web.Application,
    config: AdminConfig,
    store: Store,
    *,
    forget_key: Callable[[str], None] | None = None,
    now: Clock = system,
) -> None:
    """The admin API's routes on `app`. `forget_key(digest)` drops a key from the auth stage's
    cache once it is revoked or rotated, so that this process refuses it at once; `now` is the
    gateway's idea of now, for a key's budget period."""
    auth = AdminAuth(admin_tokens(app, config, store))
    handlers = AdminHandlers(store, forget_key or (lambda digest: None), now)

    def guarded(handler, *, writes: bool):
        async def guard(request: web.Request) -> web.StreamResponse:
            caller = await auth.caller(request)
            if writes and caller.role != "admin":
                raise _error(
                    403, f"Admin token {caller.name!r} is a viewer's: it may read, not change.", "permission_error"
                )
            try:
                return await handler(request, caller)
            except AdminError as refused:
                raise _error(refused.status, refused.message, refused.type) from None

        return guard

    for method, path, handler, writes in handlers.routes():
        app.router.add_route(method, PREFIX + path, guarded(handler, writes=writes))
    app.router.add_get(PREFIX + "/openapi.json", openapi)


async def openapi(request: web.Request) -> web.Response:
    """The API's description: public, as it holds nothing but the API's shape."""
    return _json(OPENAPI)


class AdminHandlers:
    def __init__(self, store: Store, forget_key: Callable[[str], None], now: Clock) -> None:
        self.store = store
        self.forget_key = forget_key
        self.now = now

    def routes(self) -> list[tuple[str, str, Callable, bool]]:
        """(method, path under PREFIX, handler, whether it writes)."""
        return [
            ("GET", "/keys", self.list_keys, False),
            ("POST", "/keys", self.create_key, True),
            ("GET", "/keys/{id}", self.get_key, False),
            ("PATCH", "/keys/{id}", self.update_key, True),
            ("POST", "/keys/{id}/revoke", self.revoke_key, True),
            ("POST", "/keys/{id}/rotate", self.rotate_key, True),
            ("GET", "/organizations", self.list_organizations, False),
            ("POST", "/organizations", self.create_organization, True),
            ("GET", "/organizations/{id}", self.get_organization, False),
            ("PATCH", "/organizations/{id}", self.update_organization, True),
            ("POST", "/organizations/{id}/top-up", self.top_up, True),
            ("POST", "/organizations/{id}/suspend", self.suspend, True),
            ("POST", "/organizations/{id}/resume", self.resume, True),
            ("GET", "/people", self.list_people, False),
            ("GET", "/people/{id}", self.get_person, False),
            ("POST", "/people/{id}/disable", self.disable_person, True),
            ("POST", "/people/{id}/enable", self.enable_person, True),
            ("GET", "/usage", self.usage, False),
            ("GET", "/ledger", self.ledger, False),
            ("GET", "/audit", self.audit, False),
        ]

    # --- keys

    async def list_keys(self, request: web.Request, caller: Holder) -> web.Response:
        query = request.query
        limit, after = parsing.page(query)
        revoked = parsing.flag(query, "revoked")
        organization, name = query.get("organization"), query.get("name")
        matching = [
            key
            for key in await self.store.list_keys()
            if key.id > after
            and (organization is None or key.organization == organization)
            and (name is None or key.name == name)
            and (revoked is None or key.revoked == revoked)
        ]
        reserved, now = await self.store.reserved(), self.now()  # one now for the page: one period
        page = matching[:limit]
        return _json(
            {
                "data": [_key(key, reserved, now) for key in page],
                "next": str(page[-1].id) if len(matching) > limit else None,
            }
        )

    async def create_key(self, request: web.Request, caller: Holder) -> web.Response:
        fields = parsing.key_fields(await parsing.body(request), creating=True)
        key, secret = await changes.create_key(self.store, caller.name, **fields)
        return _json({**_key(key, {}, self.now()), "secret": secret}, status=201)

    async def get_key(self, request: web.Request, caller: Holder) -> web.Response:
        return _json(_key(await self._key(request), await self.store.reserved(), self.now()))

    async def update_key(self, request: web.Request, caller: Holder) -> web.Response:
        key = await self._key(request)
        fields = parsing.key_fields(await parsing.body(request), creating=False)
        changed = await changes.update_key(self.store, caller.name, key, **fields)
        self.forget_key(key.key_sha256)
        return _json(_key(changed, await self.store.reserved(), self.now()))

    async def revoke_key(self, request: web.Request, caller: Holder) -> web.Response:
        key = await self._key(request)
        revoked = await changes.revoke_key(self.store, caller.name, key, forget_key=self.forget_key)
        return _json(_key(revoked, await self.store.reserved(), self.now()))

    async def rotate_key(self, request: web.Request, caller: Holder) -> web.Response:
        key = await self._key(request)
        rotated, secret = await changes.rotate_key(self.store, caller.name, key, forget_key=self.forget_key)
        return _json({**_key(rotated, await self.store.reserved(), self.now()), "secret": secret})

    async def _key(self, request: web.Request) -> KeyRecord:
        key_id = request.match_info["id"]
        found = await changes.find_key(self.store, key_id)
        if found is None:
            raise changes.NotFound(f"no key numbered {key_id!r}")
        return found

    # --- organizations

    async def list_organizations(self, request: web.Request, caller: Holder) -> web.Response:
        limit, after = parsing.page(request.query)
        matching = [o for o in await self.store.list_organizations() if o.id > after]
        reserved = await self.store.organizations_reserved()
        page = matching[:limit]
        return _json(
            {
                "data": [_organization(o, reserved) for o in page],
                "next": str(page[-1].id) if len(matching) > limit else None,
            }
        )

    async def create_organization(self, request: web.Request, caller: Holder) -> web.Response:
        body = await parsing.body(request)
        parsing.known(body, ("name", "balance_usd", "suspended"))
        name = body.get("name")
        if not isinstance(name, str):
            raise changes.Invalid("name: required, a string")
        made = await changes.create_organization(
            self.store,
            caller.name,
            name,
            balance_usd=parsing.money(body.get("balance_usd"), "balance_usd"),
            suspended=parsing.boolean(body.get("suspended", False), "suspended"),
        )
        return _json(_organization(made, {}), status=201)

    async def get_organization(self, request: web.Request, caller: Holder) -> web.Response:
        found = await self._organization(request)
        return _json(_organization(found, await self.store.organizations_reserved()))

    async def update_organization(self, request: web.Request, caller: Holder) -> web.Response:
        found = await self._organization(request)
        body = await parsing.body(request)
        parsing.known(body, ("balance_usd", "suspended"))
        fields: dict[str, Any] = {}
        if "balance_usd" in body:
            fields["balance_usd"] = parsing.money(body["balance_usd"], "balance_usd")
        if "suspended" in body:
            fields["suspended"] = parsing.boolean(body["suspended"], "suspended")
        changed = await changes.update_organization(self.store, caller.name, found, **fields)
        return await self._changed(changed)

    async def top_up(self, request: web.Request, caller: Holder) -> web.Response:
        found = await self._organization(request)
        body = await parsing.body(request)
        parsing.known(body, ("amount_usd",))
        if "amount_usd" not in body:
            raise changes.Invalid("amount_usd: required")
        amount = parsing.money(body["amount_usd"], "amount_usd")
        if amount is None:
            raise changes.Invalid("amount_usd: expected an amount of USD above 0")
        changed = await changes.top_up_organization(self.store, caller.name, found, amount)
        return await self._changed(changed)

    async def suspend(self, request: web.Request, caller: Holder) -> web.Response:
        changed = await changes.suspend_organization(self.store, caller.name, await self._organization(request))
        return await self._changed(changed)

    async def resume(self, request: web.Request, caller: Holder) -> web.Response:
        changed = await changes.resume_organization(self.store, caller.name, await self._organization(request))
        return await self._changed(changed)

    async def _changed(self, organization: OrganizationRecord) -> web.Response:
        """The organization as it is now; its keys' records (which carry its balance and
        suspension) dropped from this process's auth cache, so the change holds here at once."""
        for key in await self.store.list_keys():
            if key.organization_id == organization.id:
                self.forget_key(key.key_sha256)
        return _json(_organization(organization, await self.store.organizations_reserved()))

    async def _organization(self, request: web.Request) -> OrganizationRecord:
        """By its id (digits), else by its name."""
        ref = request.match_info["id"]
        if is_id(ref):
            organization_id = changes.row_id(ref)
            found = next((o for o in await self.store.list_organizations() if o.id == organization_id), None)
            if found is None:
                raise changes.NotFound(f"no organization numbered {ref}")
            return found
        found = await self.store.find_organization(ref)
        if found is None:
            raise changes.NotFound(f"no organization named {ref!r}")
        return found

    # --- people

    async def list_people(self, request: web.Request, caller: Holder) -> web.Response:
        limit, after = parsing.page(request.query)
        people = await self.store.list_people(limit=limit + 1, after=after)  # one more: whether there is a next page
        page = people[:limit]
        return _json(
            {
                "data": [person_view(person) for person in page],
                "next": str(page[-1].id) if len(people) > limit else None,
            }
        )

    async def get_person(self, request: web.Request, caller: Holder) -> web.Response:
        return _json(person_view(await self._person(request)))

    async def disable_person(self, request: web.Request, caller: Holder) -> web.Response:
        return await self._set_disabled(request, caller, True)

    async def enable_person(self, request: web.Request, caller: Holder) -> web.Response:
        return await self._set_disabled(request, caller, False)

    async def _set_disabled(self, request: web.Request, caller: Holder, disabled: bool) -> web.Response:
        """The person disabled or enabled, audited in the change's transaction; one that is so
        already is answered as it is, and nothing audited."""
        found = await self._person(request)
        changed = await changes.set_person_disabled(self.store, caller.name, found.id, disabled, self.forget_key)
        if changed is None:
            raise changes.NotFound(f"no person numbered {found.id}")
        return _json(person_view(changed))

    async def _person(self, request: web.Request) -> PersonRecord:
        ref = request.match_info["id"]
        person_id = changes.row_id(ref)
        found = await self.store.find_person(person_id) if person_id is not None else None
        if found is None:
            raise changes.NotFound(f"no person numbered {ref!r}")
        return found

    # --- usage, the ledger and the audit log

    async def usage(self, request: web.Request, caller: Holder) -> web.Response:
        query = request.query
        group_by = query.get("group_by", "day")
        if group_by not in USAGE_GROUPS:
            raise changes.Invalid("group_by: expected key, organization, person, model, deployment, day or session")
        output = query.get("format", "json")
        if output not in ("json", "csv"):
            raise changes.Invalid("format: expected json or csv")
        since, until = parsing.moment_param(query, "since"), parsing.moment_param(query, "until")
        key_id = parsing.int_param(query, "key_id", 1, 2**63 - 1)
        groups = await usage_for(self.store, by=group_by, key_id=key_id, since=since, until=until)
        if output == "csv":
            return web.Response(text=usage_csv(groups, group_by), content_type="text/csv")
        return _json(
            {
                "group_by": group_by,
                "since": since.isoformat() if since else None,
                "until": until.isoformat() if until else None,
                "data": groups,
            }
        )

    async def ledger(self, request: web.Request, caller: Holder) -> web.Response:
        query = request.query
        limit, after = parsing.page(query)
        rows = await self.store.ledger_page(
            key_id=parsing.int_param(query, "key_id", 1, 2**63 - 1),
            since=parsing.moment_param(query, "since"),
            until=parsing.moment_param(query, "until"),
            after=after,
            limit=limit + 1,  # one more: whether there is a next page
        )
        names = {key.id: key.name for key in await self.store.list_keys()}
        page = rows[:limit]
        return _json(
            {
                "data": [_ledger_row(row, names) for _, row in page],
                "next": str(page[-1][0]) if len(rows) > limit else None,
            }
        )

    async def audit(self, request: web.Request, caller: Holder) -> web.Response:
        query = request.query
        limit = parsing.int_param(query, "limit", 1, parsing.MAX_PAGE, default=parsing.DEFAULT_PAGE)
        before = parsing.int_param(query, "before", 1, 2**63 - 1)
        entries = await self.store.audit_log(limit=limit + 1, before=before)
        page = entries[:limit]
        return _json(
            {"data": [entry.view() for entry in page], "next": str(page[-1].id) if len(entries) > limit else None}
        )


# --- What goes out.


def _json(value: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(value, default=_exact), status=status, content_type="application/json")


def _exact(value: Any) -> str:
    """orjson's fallback: the only Decimals in answers are amounts of USD, which go out as exact
    decimal strings of one precision (gateway/accounting/money.py)."""
    if isinstance(value, Decimal):
        return usd_exact(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _amounts(view: dict[str, Any]) -> dict[str, Any]:
    """A stored thing's view with its amounts (its `…_usd` fields) at the API's precision."""
    return {
        name: usd_exact(value) if name.endswith("_usd") and value is not None else value for name, value in view.items()
    }


def _key(key: KeyRecord, reserved: dict[int, Decimal], now: datetime) -> dict[str, Any]:
    return _amounts({**key_view(key, now), "reserved_usd": reserved.get(key.id, Decimal(0))})


def _organization(organization: OrganizationRecord, reserved: dict[int, Decimal]) -> dict[str, Any]:
    return _amounts({**organization_view(organization), "reserved_usd": reserved.get(organization.id, Decimal(0))})


def _ledger_row(row, names: dict[int, str]) -> dict[str, Any]:
    return {
        "request_id": row.request_id,
        "key_id": row.key_id,
        "key": names.get(row.key_id),
        "model": row.model,
        "answered_model": row.answered_model,
        "deployment": row.deployment,
        "input_tokens": row.input_tokens,
        "cache_write_tokens": row.cache_write_tokens,
        "cache_write_1h_tokens": row.cache_write_1h_tokens,
        "cache_read_tokens": row.cache_read_tokens,
        "output_tokens": row.output_tokens,
        "reasoning_tokens": row.reasoning_tokens,
        "cost_usd": usd_exact(row.cost_usd),
        "status": row.outcome,
        "session": row.session,
        "started_at": row.started_at.isoformat(),
        "finished_at": row.finished_at.isoformat(),
    }
