"""`ezat-gateway keys …`, `ezat-gateway orgs …`, `ezat-gateway usage`, `ezat-gateway admin-tokens …`
and `ezat-gateway audit`: managing keys, organizations and admin tokens (the changes themselves,
and their audit entries, are gateway/admin/changes.py's, which the admin API shares), and
reading the ledger and the audit log."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson

from gateway.accounting.money import usd_text
from gateway.accounting.usage import USAGE_COLUMNS, USAGE_GROUPS, usage_csv, usage_for, usage_json, usage_table
from gateway.admin import changes
from gateway.admin.changes import AdminError
from gateway.clock import Clock, from_environment
from gateway.config import MAX_PER_MINUTE, is_id, name_problem, usd
from gateway.storage import AdminTokenRecord, KeyRecord, OrganizationRecord, Store, open_store
from middlewares.core.periods import PERIODS


def add_commands(commands: argparse._SubParsersAction, storage_options: argparse.ArgumentParser) -> None:
    keys = commands.add_parser("keys", help="create, list, revoke and update API keys")
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", parents=[storage_options], help="make a new key (shown once)")
    create.add_argument("--name", type=_name, required=True)
    _key_options(create)
    actions.add_parser("list", parents=[storage_options], help="every key, without secrets")
    revoke = actions.add_parser("revoke", parents=[storage_options], help="revoke a key")
    revoke.add_argument("key", help="the key's id (digits) or its name")
    update = actions.add_parser("update", parents=[storage_options], help="change a key's settings")
    update.add_argument("key", help="the key's id (digits) or its name")
    update.add_argument("--name", type=_name, default=argparse.SUPPRESS)
    update.add_argument("--unrevoke", action="store_true", help="make a revoked key usable again")
    _key_options(update)
    rotate = actions.add_parser("rotate", parents=[storage_options], help="give a key a new secret (shown once)")
    rotate.add_argument("key", help="the key's id (digits) or its name")

    orgs = commands.add_parser("orgs", help="create, list, suspend and update organizations")
    actions = orgs.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", parents=[storage_options], help="make a new organization")
    create.add_argument("name", type=_name)
    create.add_argument(
        "--balance",
        type=_limit,
        default=None,
        metavar="USD",
        help='what all its keys may spend together ("none", the default: no limit)',
    )
    create.add_argument("--suspended", action="store_true", help="its keys' requests are refused (403)")
    actions.add_parser("list", parents=[storage_options], help="every organization, its balance and spend")
    suspend = actions.add_parser("suspend", parents=[storage_options], help="refuse its keys' requests (403)")
    suspend.add_argument("name")
    update = actions.add_parser("update", parents=[storage_options], help="change an organization's settings")
    update.add_argument("name")
    update.add_argument(
        "--balance", type=_limit, default=argparse.SUPPRESS, metavar="USD", help='"none" removes the limit'
    )
    suspension = update.add_mutually_exclusive_group()
    suspension.add_argument("--suspend", dest="suspended", action="store_const", const=True, default=argparse.SUPPRESS)
    suspension.add_argument(
        "--unsuspend", dest="suspended", action="store_const", const=False, default=argparse.SUPPRESS
    )
    resume = actions.add_parser("resume", parents=[storage_options], help="let its keys' requests through again")
    resume.add_argument("name")
    top_up = actions.add_parser("top-up", parents=[storage_options], help="add credit to its balance")
    top_up.add_argument("name")
    top_up.add_argument("--amount", type=_amount, required=True, metavar="USD", help="USD to add (above 0)")

    usage = commands.add_parser("usage", parents=[storage_options], help="what was spent, from the ledger")
    usage.add_argument("--key", help="only this key (name or id)")
    usage.add_argument("--since", type=_since, help="only requests finished since (ISO date or datetime, UTC)")
    usage.add_argument("--until", type=_since, help="only requests finished before (ISO date or datetime, UTC)")
    usage.add_argument(
        "--by",
        choices=USAGE_GROUPS,
        default="day",
        help="deployment: by the one that answered; org (or organization): by each key's organization (as it "
        "is now); person: by the person whose key it was (an admin's keys: '(no person)'); session: by conversation (x-ezat-session, prompt_cache_key or Claude Code's session id)",
    )
    usage.add_argument("--format", choices=("table", "csv", "json"), default="table")

    tokens = commands.add_parser("admin-tokens", help="create, list and revoke the admin API's tokens")
    actions = tokens.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", parents=[storage_options], help="make a new admin token (shown once)")
    create.add_argument("--name", type=_name, required=True, help="who its changes are by, in the audit log")
    create.add_argument("--role", choices=changes.ROLES, required=True, help="viewer reads; admin also writes")
    actions.add_parser("list", parents=[storage_options], help="every admin token, without secrets")
    revoke = actions.add_parser("revoke", parents=[storage_options], help="revoke an admin token")
    revoke.add_argument("token", help="the token's id (digits) or its name")

    audit = commands.add_parser("audit", parents=[storage_options], help="who changed what: the audit log")
    audit.add_argument("--limit", type=whole_number(1, 100_000), default=50, help="entries shown (default: 50)")
    audit.add_argument("--format", choices=("table", "json"), default="table")


def _key_options(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: an option not given is absent from the namespace, so "leave as is" differs
    # from "none"/"never"/0, which clear a setting.

    def add(*names, **kwargs):
        parser.add_argument(*names, default=argparse.SUPPRESS, **kwargs)

    add("--models", nargs="+", metavar="GLOB", help='model ids it may use, e.g. "anthropic/*"')
    add("--spend-limit", type=_limit, metavar="USD", help='"none" removes the limit')
    add("--rpm", type=_count, help="requests per minute (0: no limit)")
    add("--tpm", type=_count, help="tokens per minute (0: no limit)")
    add("--max-concurrent", type=_count, metavar="N", help="requests running at once (0: no limit)")
    add("--expires", type=_moment, metavar="DATETIME", help='ISO datetime (UTC), or "never"')
    add("--org", metavar="NAME", help='the organization it belongs to (default: "default")')
    add(
        "--budget-period",
        type=_period,
        metavar="PERIOD",
        help='the period the spend limit counts over: day, week or month (UTC); "none": the key\'s whole life',
    )


# Each raises ArgumentTypeError with what it expected, which argparse prints after the option's
# name (any other exception would end in a traceback, or name the function).


def _period(text: str) -> str | None:
    if text.lower() == "none":
        return None
    if text not in PERIODS:
        raise argparse.ArgumentTypeError(f'expected day, week, month or "none", not {text!r}')
    return text


def _limit(text: str) -> Decimal | None:
    if text.lower() == "none":
        return None
    try:
        return usd(text)
    except ValueError as problem:
        raise argparse.ArgumentTypeError(f'{problem}, or "none", not {text!r}') from None


def _amount(text: str) -> Decimal:
    value = _limit(text) if text.lower() != "none" else None
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(f"expected an amount of USD above 0, not {text!r}")
    return value


def _name(text: str) -> str:
    """An argparse type: a key's, an organization's or an admin token's name (gateway.config.name_problem)."""
    problem = name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, not {text!r}")
        return value

    return parse


def _count(text: str) -> int | None:
    return whole_number(0, MAX_PER_MINUTE)(text) or None  # 0: no limit


def _moment(text: str) -> datetime | None:
    if text.lower() == "never":
        return None
    try:
        return _since(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f'expected an ISO datetime such as 2030-01-31T12:00, or "never", not {text!r}'
        ) from None


def _since(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO datetime such as 2030-01-31T12:00, not {text!r}") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


# The commands that may make a new SQLite file: a first key or organization may come before the
# gateway's first start. They make one only at an absolute path named on purpose (--storage, or
# the config's [storage]): one guessed (the demo's default, a relative path) may be another folder
# than the gateway's, where a key made would be read by no gateway. The others only read or change
# what a database holds: on a file that is not there they would make an empty one and report nothing.
MAKES_A_DATABASE = {("keys", "create"), ("orgs", "create"), ("admin-tokens", "create")}


async def run(args: argparse.Namespace, storage_url: str, *, named_by: str) -> int:
    """Runs the command on the store at `storage_url`. `named_by` says where the URL came from:
    "--storage" (typed on this command line, so not repeated back), "--config" (the file's
    [storage]) or "" (the demo's default); the last two are announced on stderr, since a relative
    SQLite path depends on the folder the command runs in."""
    path = _sqlite_path(storage_url)
    missing = path is not None and not path.exists()
    hint = _where_hint(storage_url, named_by)
    if missing and (hint or (args.command, getattr(args, "action", None)) not in MAKES_A_DATABASE):
        command = " ".join(filter(None, (args.command, getattr(args, "action", None))))
        hint = hint or "the gateway makes it when it first starts"
        print(f"ezat-gateway {command}: no database at {path}, and this command makes none; {hint}", file=sys.stderr)
        return 1
    if named_by != "--storage":
        print(f"using the database at {describe_storage(storage_url)}", file=sys.stderr)
    now = from_environment()  # once, as the command starts
    store = open_store(storage_url, now=now)
    await store.open()
    if missing:
        assert path is not None  # missing: a SQLite file that is not there
        print(f"{path.name} did not exist: created an empty one in {path.parent}", file=sys.stderr)
    try:
        return await _command(store, args, now)
    except AdminError as refused:
        print(refused.message)
        return 1
    finally:
        await store.close()


async def _command(store: Store, args: argparse.Namespace, now: Clock) -> int:
    actor = changes.cli_actor()
    if args.command == "usage":
        keys = await store.list_keys()
        key = None if args.key is None else _one_key(keys, args.key)
        if isinstance(key, str):
            print(key)
            return 1
        key_id = None if key is None else key.id
        print(
            await usage(store, by=args.by, key_id=key_id, since=args.since, until=args.until, format=args.format),
            end="",
        )
        return 0
    if args.command == "orgs":
        return await _orgs(store, args, actor)
    if args.command == "admin-tokens":
        return await _admin_tokens(store, args, actor)
    if args.command == "audit":
        entries = await store.audit_log(limit=args.limit)
        print(audit_report(entries, format=args.format), end="")
        return 0
    if args.action == "list":
        reserved = await store.reserved()
        print(_table(KEY_COLUMNS, [_key_row(key, reserved, now()) for key in await store.list_keys()]), end="")
        return 0
    fields = _changes(args) if args.action in ("create", "update") else {}
    organization = fields.pop("org", None)
    if args.action == "create":
        key, secret = await changes.create_key(store, actor, organization=organization, **fields)
        print(f"created key {key.id} ({key.name}); it is shown only this once:\n{secret}")
        return 0
    key = _one_key(await store.list_keys(), args.key)
    if isinstance(key, str):
        print(key)
        return 1
    was_revoked = key.revoked
    if args.action == "rotate":
        key, secret = await changes.rotate_key(store, actor, key, ref=args.key)
        print(f"key {key.id} ({key.name}) has a new secret; the old one no longer works. It is shown only this once:")
        print(secret)
        return 0
    if args.action == "revoke":
        key = await changes.revoke_key(store, actor, key, ref=args.key)
    else:
        if args.unrevoke:
            fields["revoked"] = False
        key = await changes.update_key(store, actor, key, organization=organization, ref=args.key, **fields)
    # The change is kept (it holds once the key is made usable again), but requests with the
    # key still get 401: an update must not read as if it had made the key work.
    if args.action == "revoke" and was_revoked:
        print(f"key {args.key!r} was revoked already", file=sys.stderr)
    elif args.action == "update" and key.revoked:
        print(
            f"key {args.key!r} is revoked: the change is kept, but its requests still get 401 "
            "(--unrevoke makes it usable again)",
            file=sys.stderr,
        )
    print(_table(KEY_COLUMNS, [_key_row(key, await store.reserved(), now())]), end="")
    return 0


async def usage(
    store: Store,
    *,
    by: str,
    key_id: int | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    format: str,
) -> str:
    """The usage report as `ezat-gateway usage` prints it (gateway/accounting/usage.py: the admin API and
    the console add up the same groups)."""
    groups = await usage_for(store, by=by, key_id=key_id, since=since, until=until)
    if format == "json":
        return usage_json(groups)
    if format == "csv":
        return usage_csv(groups, by)
    return _table([by, *USAGE_COLUMNS], usage_table(groups, by))


def _sqlite_path(url: str) -> Path | None:
    """The absolute path of a SQLite URL's file (a relative one is the working directory's);
    None for PostgreSQL, and for SQLite's in-memory database, which is no file."""
    if not url.startswith("sqlite:///") or url == "sqlite:///:memory:":
        return None
    return Path(url.removeprefix("sqlite:///")).absolute()


def describe_storage(url: str) -> str:
    """Which database `url` is, for people: a SQLite file's absolute path, or a PostgreSQL URL
    without its password (in the URL or as a query parameter)."""
    if url.startswith("sqlite:///"):
        path = _sqlite_path(url)
        return f"{path} (SQLite)" if path else "an in-memory SQLite database (gone when the command ends)"
    parts = urlsplit(url)
    user, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{user.partition(':')[0]}{at}{hosts}"
    query = urlencode([(name, value) for name, value in parse_qsl(parts.query) if name != "password"])
    return f"{urlunsplit(parts._replace(netloc=netloc, query=query))} (PostgreSQL)"


def _where_hint(url: str, named_by: str) -> str:
    """What to do about a SQLite file that was not where the command looked: the demo's default
    and a relative path are the working directory's, so a command run from another folder
    misses the gateway's file."""
    if named_by == "":
        return "run it from the folder where the gateway runs, or pass --config FILE or --storage URL"
    if not Path(url.removeprefix("sqlite:///")).is_absolute():
        return "a relative sqlite:/// path is the working directory's: run it from the folder where the gateway runs, or make the path absolute"
    return ""


async def _orgs(store: Store, args: argparse.Namespace, actor: str) -> int:
    if args.action == "list":
        reserved = await store.organizations_reserved()
        print(_table(ORG_COLUMNS, [_org_row(o, reserved) for o in await store.list_organizations()]), end="")
        return 0
    if args.action == "create":
        made = await changes.create_organization(
            store, actor, args.name, balance_usd=args.balance, suspended=args.suspended
        )
        print(_table(ORG_COLUMNS, [_org_row(made, {})]), end="")
        return 0
    found = await store.find_organization(args.name)
    if found is None:
        print(f"no organization named {args.name!r}")
        return 1
    if args.action == "suspend":
        changed = await changes.suspend_organization(store, actor, found)
    elif args.action == "resume":
        changed = await changes.resume_organization(store, actor, found)
    elif args.action == "top-up":
        changed = await changes.top_up_organization(store, actor, found, args.amount)
    else:
        fields = {
            field: getattr(args, option)
            for option, field in (("balance", "balance_usd"), ("suspended", "suspended"))
            if hasattr(args, option)
        }
        changed = await changes.update_organization(store, actor, found, **fields)
    print(_table(ORG_COLUMNS, [_org_row(changed, await store.organizations_reserved())]), end="")
    return 0


async def _admin_tokens(store: Store, args: argparse.Namespace, actor: str) -> int:
    if args.action == "create":
        token, secret = await changes.create_admin_token(store, actor, args.name, args.role)
        print(f"created admin token {token.id} ({token.name}, {token.role}); it is shown only this once:")
        print(secret)  # last, alone on its line: a script takes the output's last line
        return 0
    if args.action == "revoke":
        token = await changes.revoke_admin_token(store, actor, args.token)
        print(_table(TOKEN_COLUMNS, [_token_row(token)]), end="")
        return 0
    print(_table(TOKEN_COLUMNS, [_token_row(token) for token in await store.list_admin_tokens()]), end="")
    return 0


TOKEN_COLUMNS = ["id", "name", "role", "created_at", "revoked_at"]


def _token_row(token: AdminTokenRecord) -> list[Any]:
    return [
        token.id,
        token.name,
        token.role,
        token.created_at.isoformat(timespec="seconds"),
        token.revoked_at.isoformat(timespec="seconds") if token.revoked_at else None,
    ]


AUDIT_COLUMNS = ["id", "at", "actor", "action", "target", "before", "after"]


def audit_report(entries: list, *, format: str) -> str:
    """The audit log's entries, newest first: a table (before and after as compact JSON) or JSON."""
    if format == "json":
        return orjson.dumps([entry.view() for entry in entries], option=orjson.OPT_INDENT_2).decode() + "\n"
    lines = [
        [
            entry.id,
            entry.at.isoformat(timespec="seconds"),
            entry.actor,
            entry.action,
            entry.target,
            *(None if value is None else orjson.dumps(value).decode() for value in (entry.before, entry.after)),
        ]
        for entry in entries
    ]
    return _table(AUDIT_COLUMNS, lines)


ORG_COLUMNS = ["id", "name", "balance_usd", "spent_usd", "reserved_usd", "suspended", "keys"]


def _org_row(org: OrganizationRecord, reserved: dict[int, Decimal]) -> list[Any]:
    return [
        org.id,
        org.name,
        _usd(org.balance_usd),
        _usd(org.spent_usd),
        _usd(reserved.get(org.id, Decimal(0))),
        org.suspended,
        org.keys,
    ]


# command-line option → key field
_KEY_OPTIONS = {
    "name": "name",
    "models": "models",
    "spend_limit": "spend_limit_usd",
    "rpm": "rpm",
    "tpm": "tpm",
    "max_concurrent": "max_concurrent",
    "expires": "expires_at",
    "org": "org",
    "budget_period": "budget_period",
}


def _changes(args: argparse.Namespace) -> dict[str, Any]:
    """The key settings given on the command line (absent options change nothing)."""
    changes = {field: getattr(args, option) for option, field in _KEY_OPTIONS.items() if hasattr(args, option)}
    if "models" in changes:
        changes["models"] = tuple(changes["models"])
    return changes


KEY_COLUMNS = [
    "id",
    "name",
    "models",
    "spent_usd",
    "reserved_usd",
    "spend_limit_usd",
    "rpm",
    "tpm",
    "max_concurrent",
    "expires_at",
    "revoked",
    "organization",
    "budget_period",
    "period_spent_usd",
]


def _one_key(keys: list[KeyRecord], ref: str) -> KeyRecord | str:
    """The key `ref` names on the command line: by its id (digits), else by its name; or why
    none does (a name that several keys share is refused: their ids tell them apart)."""
    if is_id(ref):
        found = [key for key in keys if key.id == changes.row_id(ref)]
        return found[0] if found else f"no key numbered {ref}"
    named = [key for key in keys if key.name == ref]
    if len(named) > 1:
        return f"{len(named)} keys are named {ref!r}: name one by its id (keys list shows them)"
    return named[0] if named else f"no key named {ref!r}"


def _key_row(key: KeyRecord, reserved: dict[int, Decimal], now: datetime) -> list[Any]:
    return [
        key.id,
        key.name,
        ",".join(key.models),
        _usd(key.spent_usd),
        _usd(reserved.get(key.id, Decimal(0))),
        _usd(key.spend_limit_usd),
        key.rpm,
        key.tpm,
        key.max_concurrent,
        key.expires_at.isoformat() if key.expires_at else None,
        key.revoked,
        key.organization,
        key.budget_period,
        _usd(key.spent_in_period(now) if key.budget_period else None),
    ]


def _usd(amount: Decimal | None) -> str | None:
    """An amount in a table whose column says USD (blank for none: no limit)."""
    return None if amount is None else usd_text(amount, symbol=False)


def _table(header: list[str], lines: list[list[Any]]) -> str:
    cells = [header, *[["" if v is None else str(v) for v in line] for line in lines]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n" for row in cells)
