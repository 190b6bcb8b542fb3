"""The console's pages, each read from the store as it is now: the overview, the keys, a key's own
page, the organizations and the audit log. (The forms they carry post to actions.py.)"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from aiohttp import web

from gateway.accounting.money import usd_text
from gateway.accounting.usage import NO_PERSON, usage_groups
from gateway.admin.changes import find_key, row_id
from gateway.admin.console import numbers
from gateway.admin.console.html import PAGES, button_form, csrf_field, page, table, text
from gateway.admin.console.plots import budget_bar, requests_per_day, spend_per_day
from gateway.admin.console.sessions import MEMBER, Admin
from gateway.admin.policies import policy_for
from gateway.config import PolicyConfig
from gateway.storage import KeyRecord, Store
from gateway.storage.records import PersonRecord
from middlewares.core.periods import PERIODS

RECENT_REQUESTS = 50  # a key's page lists its newest requests, up to this many
AUDIT_PAGE = 100
PEOPLE_PAGE = 100
MY_PAGE = ("/console/me", "My page")
PEOPLE = ("/console/people", "People")
# A key's models and its requests count tokens alike: input, cache writes and cache reads apart
# (as the ledger keeps them: each has its price), then output.
TOKEN_FIELDS = ("input_tokens", "cache_write_tokens", "cache_read_tokens", "output_tokens")
TOKEN_COLUMNS = ("input", "cache write", "cache read", "output")


def html(body: str, *, status: int = 200) -> web.Response:
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")


class Pages:
    def __init__(
        self,
        store: Store,
        now: Callable[[], datetime],
        *,
        people: bool = False,
        policies: tuple[PolicyConfig, ...] = (),
    ) -> None:
        self.store = store
        self.now = now
        self.people = people  # people sign in through an identity provider: their pages are shown
        self.policies = policies  # [[policies]]: what a person's own keys may do

    def _page(self, admin: Admin, title: str, body: str, *, here: str = "", status: int = 200) -> web.Response:
        who = f"{admin.name} ({admin.role})"
        if admin.role == MEMBER:
            links: tuple[tuple[str, str], ...] = (MY_PAGE,)
        else:
            links = PAGES + ((PEOPLE,) if self.people else ()) + ((MY_PAGE,) if admin.person else ())
        return html(page(title, body, here=here, who=who, csrf=admin.csrf, links=links), status=status)

    # --- the overview

    async def overview(self, request: web.Request, admin: Admin) -> web.Response:
        now = self.now()
        first, last = numbers.window(now)
        month = last.replace(day=1)
        until = numbers.midnight(last + timedelta(days=1))
        recent = await self.store.ledger(since=numbers.midnight(first), until=until)
        this_month = await self.store.ledger(since=numbers.midnight(month), until=until)
        month_total = sum((group["cost_usd"] for group in numbers.groups(this_month, by="day")), start=0)
        by_day = numbers.spend_by_day(recent)
        by_key = numbers.top(numbers.groups(recent, by="key", key_ids=True))
        by_model = numbers.top(numbers.groups(recent, by="model"))
        keys = {str(key.id): key for key in await self.store.list_keys()}
        figures = (
            (f"This month ({month.strftime('%B %Y')})", usd_text(month_total)),
            (f"Last {numbers.DAYS} days", usd_text(sum(by_day.values(), start=0))),
            (f"Requests, last {numbers.DAYS} days", str(len(recent))),
        )
        body = [
            "<h1>Overview</h1>",
            '<div class="figures">'
            + "".join(f'<div class="figure">{text(label)}<b>{text(value)}</b></div>' for label, value in figures)
            + "</div>",
            f"<h2>Spend per day, {first.isoformat()} to {last.isoformat()} (UTC)</h2>",
            spend_per_day(by_day, first, last, label=f"Spend per day, last {numbers.DAYS} days"),
            f"<h2>Requests per day, {first.isoformat()} to {last.isoformat()} (UTC)</h2>",
            requests_per_day(
                numbers.requests_by_day(recent), first, last, label=f"Requests per day, last {numbers.DAYS} days"
            ),
            f"<h2>Top keys, last {numbers.DAYS} days</h2>",
            table(
                ("key", "organization", "requests", "cost"),
                (
                    (
                        _key_link(keys.get(group["key"]), _key_label(keys.get(group["key"]), group["key"])),
                        text(keys[group["key"]].organization) if group["key"] in keys else "",
                        str(group["requests"]),
                        text(usd_text(group["cost_usd"])),
                    )
                    for group in by_key
                ),
                numeric=(2, 3),
            ),
            f"<h2>Top models, last {numbers.DAYS} days</h2>",
            table(
                ("model", "requests", "output tokens", "cost"),
                (
                    (
                        text(group["model"]),
                        str(group["requests"]),
                        str(group["output_tokens"]),
                        text(usd_text(group["cost_usd"])),
                    )
                    for group in by_model
                ),
                numeric=(1, 2, 3),
            ),
        ]
        if self.people:  # who spent it, by the keys people made for themselves
            owners = {k.id: k.person_email or f"person {k.person_id}" for k in keys.values() if k.person_id is not None}
            by_person = numbers.top(usage_groups(recent, owners, by="person"))
            body.append(f"<h2>Top people, last {numbers.DAYS} days</h2>")
            body.append(
                table(
                    ("person", "requests", "cost"),
                    (
                        (text(group["person"] or NO_PERSON), str(group["requests"]), text(usd_text(group["cost_usd"])))
                        for group in by_person
                    ),
                    numeric=(1, 2),
                )
            )
        return self._page(admin, "Overview", "".join(body), here="/console")

    # --- keys

    async def keys(
        self,
        request: web.Request,
        admin: Admin,
        *,
        notice: str = "",
        error: str = "",
        status: int = 200,
    ) -> web.Response:
        """Every key, its spend against its budget; for an admin, the create form and each key's
        buttons. `notice`: HTML shown above (a new secret, once); `error`: why a change was refused."""
        now = self.now()
        keys = await self.store.list_keys()
        organizations = await self.store.list_organizations()
        rows = [
            (
                _key_link(key, str(key.id)),
                _key_link(key, key.name or "(no name)"),
                text(key.organization),
                budget_bar(key.spent_in_period(now), key.spend_limit_usd),
                text(_period(key)),
                text(_status(key, now)),
                _key_buttons(key) if admin.writes else "",
            )
            for key in keys
        ]
        body = ["<h1>Keys</h1>"]
        if error:
            body.append(f'<div class="error">{text(error)}</div>')
        if notice:
            body.append(notice)
        if admin.writes:
            options = "".join(
                f'<option value="{text(o.name)}"{" selected" if o.name == "default" else ""}>{text(o.name)}</option>'
                for o in organizations
            )
            body.append(
                '<h2>New key</h2><form class="inline" method="post" action="/console/keys">'
                + csrf_field(admin.csrf)
                + '<label>Name <input name="name" required maxlength="200"></label> '
                + f'<label>Organization <select name="organization">{options}</select></label> '
                + '<label>Spend limit (USD) <input name="spend_limit_usd" inputmode="decimal" size="8" '
                + 'placeholder="none"></label> '
                + '<label>per <select name="budget_period"><option value="">its whole life</option>'
                + "".join(f'<option value="{period}">{period}</option>' for period in PERIODS)
                + "</select></label> "
                + "<button>Create key</button></form>"
            )
        body.append("<h2>All keys</h2>")
        body.append(table(("id", "name", "organization", "spend / budget", "period", "status", ""), rows))
        return self._page(admin, "Keys", "".join(body), here="/console/keys", status=status)

    async def key(self, request: web.Request, admin: Admin) -> web.Response:
        key = await find_key(self.store, request.match_info["id"])
        if key is None:
            return self._page(admin, "No such key", "<h1>No such key</h1>", status=404)
        now = self.now()
        first, last = numbers.window(now)
        rows = await self.store.ledger(
            key_id=key.id, since=numbers.midnight(first), until=numbers.midnight(last + timedelta(days=1))
        )
        by_model = numbers.top(numbers.groups(rows, by="model"), n=50)
        settings = (
            ("organization", text(key.organization)),
            ("models it may use", text(", ".join(key.models))),
            ("spend / budget", budget_bar(key.spent_in_period(now), key.spend_limit_usd)),
            ("budget period", text(_period(key))),
            ("spent in all", text(usd_text(key.spent_usd))),
            ("requests per minute", text(key.rpm or "no limit")),
            ("tokens per minute", text(key.tpm or "no limit")),
            ("requests at once", text(key.max_concurrent or "no limit")),
            ("expires", text(key.expires_at.isoformat() if key.expires_at else "never")),
            ("status", text(_status(key, now))),
        )
        recent = rows[-RECENT_REQUESTS:][::-1]
        body = [
            f"<h1>Key {key.id}: {text(key.name or '(no name)')}</h1>",
            _key_buttons(key) if admin.writes else "",
            table(("setting", "value"), settings),
            f"<h2>Spend per day, {first.isoformat()} to {last.isoformat()} (UTC)</h2>",
            spend_per_day(numbers.spend_by_day(rows), first, last, label=f"Spend per day of key {key.id}"),
            f"<h2>Models, last {numbers.DAYS} days</h2>",
            table(
                ("model", "requests", *TOKEN_COLUMNS, "cost"),
                (
                    (
                        text(g["model"]),
                        str(g["requests"]),
                        *(str(g[name]) for name in TOKEN_FIELDS),
                        text(usd_text(g["cost_usd"])),
                    )
                    for g in by_model
                ),
                numeric=range(1, 7),
            ),
            f"<h2>Recent requests (the newest {RECENT_REQUESTS}, last {numbers.DAYS} days)</h2>",
            table(
                ("finished (UTC)", "request id", "model", "answered by", *TOKEN_COLUMNS, "cost", "outcome"),
                (
                    (
                        text(row.finished_at.strftime("%Y-%m-%d %H:%M:%S")),
                        f"<code>{text(row.request_id)}</code>",
                        text(row.model),
                        text(row.answered_model),
                        *(str(getattr(row, name)) for name in TOKEN_FIELDS),
                        text(usd_text(row.cost_usd)),
                        text(row.outcome),
                    )
                    for row in recent
                ),
                numeric=range(4, 9),
            ),
        ]
        return self._page(admin, f"Key {key.id}", "".join(body), here="/console/keys")

    def confirmation(
        self, admin: Admin, question: str, consequence: str, *, action: str, button: str, cancel: str, danger: bool
    ) -> web.Response:
        """A page that asks before a change: `question`, what the change does, and its one
        button, which POSTs to `action`; Cancel is a link back to `cancel`."""
        body = (
            f"<h1>{text(question)}</h1><p>{text(consequence)}</p>"
            f'<div class="confirm">{button_form(action, button, admin.csrf, danger=danger)}'
            f'<a href="{text(cancel)}">Cancel</a></div>'
        )
        return self._page(admin, question, body, here="/console/keys")

    # --- organizations and the audit log

    async def organizations(self, request: web.Request, admin: Admin) -> web.Response:
        reserved = await self.store.organizations_reserved()
        rows = (
            (
                text(o.id),
                text(o.name),
                budget_bar(o.spent_usd, o.balance_usd),
                text(usd_text(reserved.get(o.id, 0))),
                text(o.keys),
                "suspended" if o.suspended else "active",
                "config file" if o.from_config else "store",
            )
            for o in await self.store.list_organizations()
        )
        body = "<h1>Organizations</h1>" + table(
            ("id", "name", "spent / balance", "held now", "keys", "status", "declared in"), rows, numeric=(3, 4)
        )
        return self._page(admin, "Organizations", body, here="/console/organizations")

    # --- people (signed in through the identity provider)

    async def people_list(
        self, request: web.Request, admin: Admin, *, error: str = "", status: int = 200
    ) -> web.Response:
        after = row_id(request.query.get("after", ""))
        people = await self.store.list_people(limit=PEOPLE_PAGE, after=after)
        rows = (
            (
                text(person.id),
                text(person.email),
                text(person.name),
                text(", ".join(person.groups)),
                text(person.last_seen.strftime("%Y-%m-%d %H:%M")),
                "disabled" if person.disabled else "active",
                _person_button(person, admin.csrf) if admin.writes else "",
            )
            for person in people
        )
        body = ["<h1>People</h1>"]
        if error:
            body.append(f'<div class="error">{text(error)}</div>')
        body.append(table(("id", "email", "name", "groups", "last seen (UTC)", "status", ""), rows))
        if len(people) == PEOPLE_PAGE:
            body.append(f'<p><a href="/console/people?after={people[-1].id}">More people</a></p>')
        return self._page(admin, "People", "".join(body), here=PEOPLE[0], status=status)

    async def me(
        self, request: web.Request, admin: Admin, *, notice: str = "", error: str = "", status: int = 200
    ) -> web.Response:
        """A person's own page: who the gateway takes them for, as of their last sign-in, their
        group's policy, and their keys, with the form that makes one. `notice`: HTML shown above
        (a new secret, once); `error`: why a change was refused."""
        person = admin.person
        if person is None:  # an admin token's session: no person behind it
            alone = "<h1>My page</h1><p>Signed in with an admin token: there is no person behind it.</p>"
            return self._page(admin, "My page", alone, here=MY_PAGE[0])
        facts = (
            ("Email", person.email),
            ("Name", person.name),
            ("Groups (as of your last sign-in)", ", ".join(person.groups) or "none"),
            ("Role on this console", admin.role),
            ("First seen (UTC)", person.first_seen.strftime("%Y-%m-%d %H:%M")),
        )
        body = ["<h1>My page</h1>"]
        if error:
            body.append(f'<div class="error">{text(error)}</div>')
        if notice:
            body.append(notice)
        body.append(table(("", ""), ((text(label), text(value)) for label, value in facts)))
        body.append("<h2>My keys</h2>")
        policy = policy_for(person.groups, self.policies)
        if policy is None:
            body.append("<p>None of your groups has a policy on this gateway: you cannot make a key.</p>")
        else:
            rates = ", ".join(f"{n} {unit}" for n, unit in ((policy.rpm, "requests"), (policy.tpm, "tokens")) if n)
            body.append(
                f"<p>Your group <b>{text(policy.group)}</b>'s policy: models {text(', '.join(policy.models))}; "
                f"{text(rates + ' a minute' if rates else 'no rate limit')}; a key lives "
                f"{policy.key_ttl_hours} hours.</p>"
                '<form class="inline" method="post" action="/console/me/keys">'
                + csrf_field(admin.csrf)
                + '<label>Name <input name="name" maxlength="200" placeholder="laptop"></label> '
                + "<button>Make a key</button></form>"
            )
        now = self.now()
        keys = await self.store.list_person_keys(person.id)
        if policy is not None and policy.budget_usd is not None and policy.budget_period is not None:
            # Every key of theirs carries the person's spend; with none yet, nothing is spent.
            spent = keys[0].person_spend.in_period(policy.budget_period, now) if keys else Decimal(0)
            body.append(
                f"<p>Your budget, over all your keys, this {policy.budget_period}: "
                f"{budget_bar(spent, policy.budget_usd)}</p>"
            )
        rows = (
            (
                text(key.id),
                text(key.name or "(no name)"),
                text(key.expires_at.strftime("%Y-%m-%d %H:%M") if key.expires_at else "never"),
                text(_status(key, now)),
                ""
                if key.revoked or key.expired(now)
                else button_form(f"/console/me/keys/{key.id}/revoke", "Revoke", admin.csrf, danger=True),
            )
            for key in keys
        )
        body.append(table(("id", "name", "expires (UTC)", "status", ""), rows))
        return self._page(admin, "My page", "".join(body), here=MY_PAGE[0], status=status)

    async def audit(self, request: web.Request, admin: Admin) -> web.Response:
        before = request.query.get("before", "")
        entries = await self.store.audit_log(limit=AUDIT_PAGE, before=row_id(before))
        rows = (
            (
                text(entry.id),
                text(entry.at.strftime("%Y-%m-%d %H:%M:%S")),
                text(entry.actor),
                text(entry.action),
                text(entry.target),
                *_changes(entry.before, entry.after),
            )
            for entry in entries
        )
        body = ["<h1>Audit log</h1>", table(("id", "at (UTC)", "actor", "action", "target", "before", "after"), rows)]
        if len(entries) == AUDIT_PAGE:
            body.append(f'<p><a href="/console/audit?before={entries[-1].id}">Older entries</a></p>')
        return self._page(admin, "Audit log", "".join(body), here="/console/audit")


def _person_button(person: PersonRecord, csrf: str) -> str:
    if person.disabled:
        return button_form(f"/console/people/{person.id}/enable", "Enable", csrf)
    return button_form(f"/console/people/{person.id}/disable", "Disable", csrf, danger=True)


def _key_link(key: KeyRecord | None, label: str) -> str:
    if key is None:
        return text(label)
    return f'<a href="/console/keys/{key.id}">{text(label)}</a>'


def _key_label(key: KeyRecord | None, ref: str) -> str:
    return f"{key.name or '(no name)'} ({key.id})" if key is not None else f"key {ref}"


def _key_buttons(key: KeyRecord) -> str:
    """Rotate and revoke, for a key the console may change (the config file's are its own): links
    to the pages that ask first (actions.py)."""
    if key.from_config or key.revoked:
        return ""
    return (
        f'<a class="button" href="/console/keys/{key.id}/rotate">Rotate</a> '
        f'<a class="button danger" href="/console/keys/{key.id}/revoke">Revoke</a>'
    )


def _period(key: KeyRecord) -> str:
    return key.budget_period or ("lifetime" if key.spend_limit_usd is not None else "")


def _status(key: KeyRecord, now: datetime) -> str:
    if key.revoked:
        return "revoked"
    if key.expired(now):
        return "expired"
    return "active (config file)" if key.from_config else "active"


def _changes(before: dict | None, after: dict | None) -> tuple[str, str]:
    """An audit entry's before and after, as fields: of a thing changed, the fields that changed
    (the whole of each in a <details>); of one made or ended, the whole of it."""
    if before is None or after is None:
        return _fields(before), _fields(after)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    shown_before, shown_after = (
        _fields({name: whole.get(name) for name in changed})
        + f"<details><summary>all fields</summary>{_fields(whole)}</details>"
        for whole in (before, after)
    )
    return shown_before, shown_after


def _fields(view: dict | None) -> str:
    """A thing's fields as a list of names and values, read as a person would write them."""
    if view is None:
        return ""
    items = "".join(f"<dt>{text(name)}</dt><dd>{text(_value(name, view[name]))}</dd>" for name in sorted(view))
    return f'<dl class="fields">{items}</dl>'


def _value(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    if name.endswith("_usd"):  # an amount (kept as an exact decimal string), at people's precision
        return usd_text(value)
    return str(value)
