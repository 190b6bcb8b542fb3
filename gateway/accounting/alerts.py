"""Alerts ([[alerts]]): a webhook told when a key has used a share of its spend limit (its
period's, with a budget_period) or an organization a share of its balance.

Each ledger commit names the keys whose spend it raised (`Alerts.spent`); a check beside the
requests reads them, and each threshold they have crossed is recorded in the store once
(`Store.claim_alert`, whose unique key makes it once across workers, replicas and restarts).
Each process then POSTs what is due, an alert leased to one process at a time, retried with
backoff until it is delivered or a day old: at least once, as a POST that went through may be
sent again when its success could not be recorded. Each POST is signed with the entry's secret,
over the time it was sent and its body (`x-ezat-signature: t=<unix seconds>,v1=<hex
HMAC-SHA256 of "t.body">`), so a webhook can refuse an old one replayed; `x-ezat-delivery`
names the alert, the same on every attempt, for the webhook to drop a repeat. A webhook must be
at a public address, as image downloads must, unless its entry says `allow_private_hosts`."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import time
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from gateway.clock import Clock, system
from gateway.config import AlertConfig
from gateway.ops.metrics import NO_METRICS, Metrics, NoMetrics
from gateway.storage import Alert, AlertDelivery, KeyRecord, LedgerRow, OrganizationRecord, Store
from gateway.storage.unavailable import StoreUnavailable
from middlewares.core.addresses import PublicOnlyResolver, is_public, literal_address
from middlewares.core.periods import next_start, period_start

log = logging.getLogger("ezat.alerts")

SIGNATURE, DELIVERY = "x-ezat-signature", "x-ezat-delivery"
TIMEOUT = 10.0  # seconds a webhook has to answer
LEASE = 60.0  # seconds an alert is one process's to send: longer than an attempt takes
FIRST_RETRY, LONGEST_RETRY = 2.0, 600.0  # seconds before the next attempt: doubling, at most this
GIVE_UP_AFTER = 86400.0  # an alert not delivered a day after it was recorded is given up
POLL = 15.0  # seconds between looks for alerts due (another process's, or one retried)
RECHECK_AFTER = 5.0  # seconds before a check the store failed is tried again
MAX_REMEMBERED = 100_000  # alerts known to be recorded, kept in memory (then forgotten, and asked again)


class Alerts:
    """Checks spend against the [[alerts]] entries' thresholds and delivers what they cross."""

    def __init__(
        self,
        entries: Sequence[AlertConfig],
        store: Store,
        *,
        metrics: Metrics | NoMetrics = NO_METRICS,
        poll_seconds: float = POLL,
        first_retry: float = FIRST_RETRY,
        now: Clock = system,
    ) -> None:
        self._entries = tuple(entries)
        self._by_url = {entry.webhook_url: entry for entry in reversed(self._entries)}  # the first entry wins
        self._store, self._metrics = store, metrics
        self._poll, self._first_retry = poll_seconds, first_retry
        self._now = now  # the gateway's clock, for budget periods
        self._changed: set[int] = set()  # keys whose spend rose, not checked yet
        self._checking: asyncio.Task[None] | None = None
        self._due = asyncio.Event()  # set: look for alerts due now
        self._sessions: dict[bool, aiohttp.ClientSession] = {}  # allow_private_hosts → its session
        self._running = False  # between the app's start and its cleanup
        # Alerts this process knows are recorded (webhook, subject, period, threshold): not
        # claimed again at every commit of a key past a threshold.
        self._recorded: set[tuple[str, str, str, str]] = set()
        self._used_up: set[tuple[str, int]] = set()  # ("key" | "organization", id): refused for want of budget

    def spent(self, rows: Sequence[LedgerRow]) -> None:
        """The ledger committed `rows`: their keys are checked soon, nothing waits for it."""
        self._check_soon(row.key_id for row in rows)

    def used_up(self, key: KeyRecord, of: str) -> None:
        """A request was refused because what is left of the key's budget (`of="key"`) or of its
        organization's balance (`of="organization"`) cannot pay for even its input: used up, though
        the spend recorded is short of the limit (requests are refused before they would pass it,
        so spend seldom reaches it). Every threshold is crossed, 1.0 included."""
        self._used_up.add((of, key.organization_id if of == "organization" else key.id))
        self._check_soon((key.id,))

    def _check_soon(self, key_ids) -> None:
        if not self._running:
            return  # the app is stopping: its last changes are not checked
        self._changed.update(key_ids)
        if self._checking is None:
            self._checking = asyncio.create_task(self._check(), context=contextvars.Context())

    async def lifespan(self, app: web.Application):
        """aiohttp cleanup context: the webhooks' connections and the delivery loop."""
        for private in {entry.allow_private_hosts for entry in self._entries}:
            self._sessions[private] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(resolver=None if private else PublicOnlyResolver()),
                timeout=aiohttp.ClientTimeout(total=TIMEOUT),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        delivering = asyncio.create_task(self._deliver_loop(), context=contextvars.Context())
        self._running = True
        yield
        self._running = False
        delivering.cancel()
        for task in (delivering, self._checking):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        for session in self._sessions.values():
            await session.close()

    # --- crossing thresholds

    async def _check(self) -> None:
        try:
            while self._changed:
                key_ids, self._changed = sorted(self._changed), set()
                try:
                    claimed = await self._claim_crossed(await self._store.keys_by_id(key_ids))
                except Exception as exc:  # the store may be briefly away: these keys are checked again
                    if not isinstance(exc, StoreUnavailable):  # an outage is logged once, as it begins
                        log.exception("checking spend against the alerts' thresholds failed")
                    self._changed.update(key_ids)
                    await asyncio.sleep(RECHECK_AFTER)
                    continue
                if claimed:
                    self._due.set()
        finally:
            self._checking = None

    async def _claim_crossed(self, keys: list[KeyRecord]) -> bool:
        now = self._now()
        alerts = [alert for key in keys for alert in self._key_alerts(key, now)]
        if any(key.organization_balance_usd for key in keys):
            named = {key.organization_id for key in keys}
            organizations = [o for o in await self._store.list_organizations() if o.id in named]
            alerts += [
                alert for organization in organizations for alert in self._organization_alerts(organization, now)
            ]
        claimed = False
        for alert in alerts:  # each one this process has not recorded yet (_crossed)
            claimed |= await self._store.claim_alert(alert)
            if len(self._recorded) >= MAX_REMEMBERED:
                self._recorded.clear()
            self._recorded.add(alert[:4])
        return claimed

    def _key_alerts(self, key: KeyRecord, now) -> list[Alert]:
        limit = key.spend_limit_usd
        if not limit:
            return []
        about = {"kind": "key", "id": key.id, "name": key.name, "organization": key.organization}
        what: dict[str, str | None]
        if key.budget_period is None:
            period, what = f"lifetime limit {limit}", {"period": None, "period_start": None, "resets_on": None}
        else:
            start = period_start(key.budget_period, now)
            period = start.isoformat()
            what = {
                "period": key.budget_period,
                "period_start": period,
                "resets_on": next_start(key.budget_period, now).isoformat(),
            }
        spent = key.spent_in_period(now)
        counted = limit if self._take_used_up("key", key.id) else spent
        return self._crossed(f"key:{key.id}", period, about, spent, counted, limit, what, now)

    def _organization_alerts(self, organization: OrganizationRecord, now) -> list[Alert]:
        balance = organization.balance_usd
        if not balance:
            return []
        about = {"kind": "organization", "id": organization.id, "name": organization.name}
        what = {"period": None, "period_start": None, "resets_on": None}
        # A top-up changes the balance: its thresholds may be crossed again.
        period = f"balance {balance}"
        spent = organization.spent_usd
        counted = balance if self._take_used_up("organization", organization.id) else spent
        return self._crossed(f"organization:{organization.id}", period, about, spent, counted, balance, what, now)

    def _take_used_up(self, kind: str, owner: int) -> bool:
        used_up = (kind, owner) in self._used_up
        self._used_up.discard((kind, owner))
        return used_up

    def _crossed(
        self, subject: str, period: str, about: dict, spent: Decimal, counted: Decimal, limit: Decimal, what: dict, now
    ) -> list[Alert]:
        """The alerts of the thresholds `counted` (the spend, or the limit when it is used up)
        has reached, but for those this process has recorded already (a body is made only for an
        alert that may be new); their bodies say the spend as recorded."""
        alerts = []
        for entry in self._entries:
            for threshold in entry.thresholds:
                known = (entry.webhook_url, subject, period, str(threshold))
                if counted >= limit * Decimal(str(threshold)) and known not in self._recorded:
                    body: dict[str, Any] = {
                        "type": "ezat.spend_alert",
                        "threshold": threshold,
                        "about": about,
                        "spent_usd": str(spent),
                        "limit_usd": str(limit),
                        **what,
                        "at": now.isoformat(),
                    }
                    alerts.append(Alert(*known, orjson.dumps(body)))
        return alerts

    # --- delivery

    async def _deliver_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._due.wait(), self._poll)
            except TimeoutError:
                pass
            self._due.clear()
            try:
                due, given_up = await self._store.due_alerts(LEASE, GIVE_UP_AFTER)
            except StoreUnavailable:  # the next look tries again; an outage is logged once
                continue
            except Exception:  # the store may be briefly away: the next look tries again
                log.exception("looking for alerts to send failed")
                continue
            for _ in range(given_up):
                self._metrics.alert("given_up")
            if given_up:
                log.error("%d alerts were given up: not delivered within a day", given_up)
            # Each delivery's failures are its own: none ends this loop.
            await asyncio.gather(*(self._deliver(alert) for alert in due), return_exceptions=True)

    async def _deliver(self, alert: AlertDelivery) -> None:
        entry = self._by_url.get(alert.webhook_url)
        host = URL(alert.webhook_url).host  # not the URL: a webhook's path may be its secret
        try:
            if entry is None:
                raise LookupError("no [[alerts]] entry has this webhook_url any more")
            await self._post(entry, alert)
        except Exception as exc:  # the webhook, the network, or a refused address: tried again later
            retry_in = min(self._first_retry * 2**alert.attempts, LONGEST_RETRY)
            log.warning("alert %d to %s failed (attempt %d): %s", alert.id, host, alert.attempts + 1, exc)
            self._metrics.alert("failed")
            try:
                await self._store.alert_failed(alert.id, retry_in, str(exc) or type(exc).__name__)
            except Exception:
                log.exception("recording alert %d's failure failed", alert.id)
            asyncio.get_running_loop().call_later(retry_in, self._due.set)
            return
        self._metrics.alert("sent")
        try:
            await self._store.alert_sent(alert.id)
        except Exception:  # its lease runs out, and it is sent again: twice rather than never
            log.exception("recording alert %d as sent failed", alert.id)

    async def _post(self, entry: AlertConfig, alert: AlertDelivery) -> None:
        url = URL(entry.webhook_url)
        literal = literal_address(url.host or "")
        if literal is not None and not entry.allow_private_hosts and not is_public(literal):
            raise ValueError(f"{url.host} is not a public address (allow_private_hosts is off)")
        body = alert.payload
        headers = {
            "content-type": "application/json",
            SIGNATURE: signature(entry.secret, int(time.time()), body),
            DELIVERY: delivery_id(alert),
        }
        # No redirects: a redirect's address would escape the public-address rule (an IP literal
        # is never resolved), so a 3xx is a failure, as for image downloads.
        session = self._sessions[entry.allow_private_hosts]
        async with session.post(url, data=body, headers=headers, allow_redirects=False) as response:
            if response.status >= 300:
                raise ValueError(f"the webhook answered {response.status}")


def signature(secret: str, sent_at: int, body: bytes) -> str:
    """The `x-ezat-signature` of `body` sent at `sent_at` (Unix seconds: the real time, never
    the budget periods' clock, since a webhook compares it with its own)."""
    digest = hmac.new(secret.encode(), f"{sent_at}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={sent_at},v1={digest}"


def delivery_id(alert: AlertDelivery) -> str:
    """The `x-ezat-delivery` of an alert: the same on every attempt, another for every other
    alert. It digests the webhook and the body, which says whose threshold, which, in what
    period and when it was crossed; a row's number would repeat in another store's alerts."""
    return hashlib.sha256(alert.webhook_url.encode() + b"\n" + alert.payload).hexdigest()[:32]
