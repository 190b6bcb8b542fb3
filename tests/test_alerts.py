"""Spend alerts ([[alerts]]): a webhook on loopback is POSTed once per threshold a key's budget
(or an organization's balance) crosses, per period, signed as docs/admin.md's own code verifies;
retried when it fails, under the same delivery id; never twice across two workers on one store;
and refused a private address unless the entry allows it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sqlite3
import textwrap
import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import openai
import pytest
from aiohttp import web

from gateway.app import STORE
from gateway.config import AlertConfig, ConfigError, KeyConfig, OrganizationConfig, StorageConfig, load_config
from gateway.mock.upstream import Scenario
from tests.support import KEY, MODEL, SERVE_CONFIG, ServeProcess, SetClock, make_config
from tests.test_operations import access_lines, scrape
from tests.test_routing import both_workers_listening
from tests.test_storage import query, store_url  # noqa: F401 (fixture)

SECRET = "webhook-secret"
# An answer's 1,000 output tokens cost $0.015 at the test model's $15 a million; asking for 100
# reserves little, so a request passes while the key has $0.0016 left.
ANSWER = dict(blocks=[{"type": "text", "text": "Done."}], usage={"input_tokens": 0, "output_tokens": 1000})


def documented_verification():
    """The `verified(secret, signature, body)` of docs/admin.md's alerts section, run as written."""
    text = (Path(__file__).parent.parent / "docs" / "admin.md").read_text()
    section = text[text.index("\n## Alerts\n") :]
    section = section[: section.index("\n## ", 1)]
    [code] = re.findall(r"```python\n(.*?)^ *```", section, re.S | re.M)
    namespace: dict = {}
    exec(textwrap.dedent(code), namespace)
    return namespace["verified"]


verified = documented_verification()


def sent_at(headers: dict) -> int:
    """The time a delivery says it was signed at (its signature's `t`)."""
    signed = re.fullmatch(r"t=(\d+),v1=[0-9a-f]{64}", headers["x-ezat-signature"])
    assert signed is not None, headers["x-ezat-signature"]
    return int(signed[1])


class Webhook:
    """A webhook on loopback: it keeps what it was POSTed, and answers 500 to the first `failing`."""

    def __init__(self, failing: int = 0, redirect: bool = False) -> None:
        self.received: list[tuple[dict, bytes]] = []  # (headers, body)
        self.attempts: list[dict] = []  # every POST's headers, those it failed included
        self.failing = failing
        self.redirect = redirect  # answer with a 307 to /elsewhere, which keeps what it gets too
        self.url = ""

    async def start(self) -> Webhook:
        app = web.Application()
        app.router.add_post("/hook", self._hook)
        app.router.add_post("/elsewhere", self._hook)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/hook"
        return self

    async def _hook(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.attempts.append(dict(request.headers))
        if self.redirect and request.path == "/hook":
            raise web.HTTPTemporaryRedirect("/elsewhere")
        if self.failing:
            self.failing -= 1
            return web.Response(status=500)
        self.received.append((dict(request.headers), body))
        return web.Response(status=204)

    async def receive(self, count: int, within: float = 15.0) -> list[dict]:
        """The first `count` bodies, their signatures checked with the documented code and
        signed just now, once that many came; then a moment more, in which no other may come."""
        for _ in range(int(within * 20)):
            if len(self.received) >= count:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert len(self.received) == count, [json.loads(body) for _, body in self.received]
        for headers, body in self.received:
            assert verified(SECRET.encode(), headers["x-ezat-signature"], body)
            assert abs(sent_at(headers) - time.time()) < 60  # the real time, not EZAT_NOW's
            assert headers["Content-Type"] == "application/json"
        return [json.loads(body) for _, body in self.received]

    async def stop(self) -> None:
        await self._runner.cleanup()


async def webhook_started(failing: int = 0, redirect: bool = False) -> Webhook:
    return await Webhook(failing, redirect).start()


async def after_first_attempt(storage: str) -> list[tuple]:
    """The alerts' (attempts, last_error, delivered_at) once the first has been tried (5 s at most)."""
    for _ in range(100):
        rows = await query(storage, "SELECT attempts, last_error, delivered_at FROM alerts")
        if rows and rows[0][0]:
            break
        await asyncio.sleep(0.05)
    return [tuple(row) for row in rows]


def alerting_config(upstream, storage_url: str, webhook: Webhook, **key_fields):
    config = make_config(upstream.url, storage_url)
    key = KeyConfig(name="team", key_sha256=hashlib.sha256(KEY.encode()).hexdigest(), **key_fields)
    alert = AlertConfig(webhook_url=webhook.url, secret=SECRET, allow_private_hosts=True)
    return replace(config, keys=(key,), alerts=(alert,), storage=StorageConfig(url=storage_url))


async def spend_half(gateway, upstream) -> None:
    """One request the upstream bills 40,000 output tokens: $0.60, over half of a $1 budget and
    under 80 % of it, so that exactly the 0.5 threshold is crossed."""
    upstream.enqueue(Scenario(usage={"input_tokens": 0, "output_tokens": 40_000}))
    async with gateway.client() as client:
        await client.chat.completions.create(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Hi"}])


async def spend(client, times: int) -> None:
    for _ in range(times):
        await client.chat.completions.create(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Hi"}])


async def test_each_threshold_is_posted_once_signed(start_gateway, upstream, store_url):
    webhook = await webhook_started()
    config = alerting_config(upstream, store_url, webhook, spend_limit_usd=Decimal("0.06"), budget_period="month")
    gateway = await start_gateway(config, now=SetClock("2026-12-15T10:00:00Z"))
    upstream.enqueue(*(Scenario(**ANSWER) for _ in range(4)))
    async with gateway.client() as client:
        await spend(client, 2)  # $0.03 of $0.06: half
        [half] = await webhook.receive(1)
        await spend(client, 2)  # $0.06: 80 % and all of it, together
    *_, eighty, used = await webhook.receive(3)
    assert half == {
        "type": "ezat.spend_alert",
        "threshold": 0.5,
        "about": {"kind": "key", "id": half["about"]["id"], "name": "team", "organization": "default"},
        "spent_usd": "0.030",
        "limit_usd": "0.06",
        "period": "month",
        "period_start": "2026-12-01",
        "resets_on": "2027-01-01",
        "at": "2026-12-15T10:00:00+00:00",
    }
    assert [(eighty["threshold"], eighty["spent_usd"]), (used["threshold"], used["spent_usd"])] == [
        (0.8, "0.060"),
        (1.0, "0.060"),
    ]
    delivery_ids = [headers["x-ezat-delivery"] for headers, _ in webhook.received]
    assert len(set(delivery_ids)) == 3 and all(re.fullmatch("[0-9a-f]{32}", id) for id in delivery_ids)
    samples = await scrape(gateway.url)
    assert samples[("ezat_alerts_total", (("outcome", "sent"),))] == 3
    # Recorded once each, delivered.
    rows = await query(store_url, "SELECT threshold, attempts, delivered_at IS NOT NULL FROM alerts ORDER BY id")
    assert [tuple(row) for row in rows] == [("0.5", 1, True), ("0.8", 1, True), ("1.0", 1, True)]
    await webhook.stop()


async def test_a_budget_too_short_for_a_requests_input_is_used_up(start_gateway, upstream, tmp_path):
    # Requests are refused before they would pass the limit, so spend seldom reaches it: a 402 for
    # a request whose input alone does not fit says the budget is used up (threshold 1.0).
    webhook = await webhook_started()
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    gateway = await start_gateway(alerting_config(upstream, storage, webhook, spend_limit_usd=Decimal("0.05")))
    upstream.enqueue(*(Scenario(**ANSWER) for _ in range(3)))
    async with gateway.client() as client:
        await spend(client, 3)  # $0.045: 50 % and 80 %
        await webhook.receive(2)
        with pytest.raises(openai.APIStatusError) as refused:  # 40,000 characters: $0.0375 of input alone
            await client.chat.completions.create(
                model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "x" * 40_000}]
            )
        assert refused.value.status_code == 402
    *_, used = await webhook.receive(3)
    assert (used["threshold"], used["spent_usd"], used["limit_usd"]) == (1.0, "0.045", "0.05")
    await webhook.stop()


async def test_a_new_period_alerts_again(start_gateway, upstream, tmp_path):
    now = SetClock("2026-12-31T23:00:00Z")
    webhook = await webhook_started()
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    gateway = await start_gateway(
        alerting_config(upstream, storage, webhook, spend_limit_usd=Decimal("0.03"), budget_period="month"),
        now=now,
    )
    upstream.enqueue(*(Scenario(**ANSWER) for _ in range(3)))
    async with gateway.client() as client:
        await spend(client, 1)  # half of December's
        await webhook.receive(1)
        now.set("2027-01-01T00:30:00Z")
        await spend(client, 1)  # half of January's: a new period, its own alert
        await webhook.receive(2)
        await spend(client, 1)  # all of January's
    posted = await webhook.receive(4)
    assert [(alert["period_start"], alert["threshold"]) for alert in posted] == [
        ("2026-12-01", 0.5),
        ("2027-01-01", 0.5),
        ("2027-01-01", 0.8),
        ("2027-01-01", 1.0),
    ]
    await webhook.stop()


async def test_a_webhook_that_fails_is_tried_again(start_gateway, upstream, tmp_path, caplog):
    webhook = await webhook_started(failing=1)
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    gateway = await start_gateway(alerting_config(upstream, storage, webhook, spend_limit_usd=Decimal("1")))
    await spend_half(gateway, upstream)
    [alert] = await webhook.receive(1, within=10)  # the first attempt got a 500; the next, 2 s on, went through
    assert (alert["threshold"], alert["period"], alert["spent_usd"], alert["limit_usd"]) == (0.5, None, "0.60", "1")
    assert "the webhook answered 500" in caplog.text
    # The retry is the same delivery, signed anew: a webhook that took the first drops it.
    failed, delivered = webhook.attempts
    assert failed["x-ezat-delivery"] == delivered["x-ezat-delivery"]
    assert sent_at(failed) <= sent_at(delivered)
    [(attempts, error)] = await query(storage, "SELECT attempts, last_error FROM alerts")
    assert (attempts, error) == (2, None)
    samples = await scrape(gateway.url)
    assert samples[("ezat_alerts_total", (("outcome", "failed"),))] == 1
    assert samples[("ezat_alerts_total", (("outcome", "sent"),))] == 1
    await webhook.stop()


async def test_the_documented_code_verifies_a_delivery_and_refuses_a_replay(
    start_gateway, upstream, tmp_path, monkeypatch
):
    webhook = await webhook_started()
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    gateway = await start_gateway(alerting_config(upstream, storage, webhook, spend_limit_usd=Decimal("1")))
    await spend_half(gateway, upstream)
    await webhook.receive(1)
    await webhook.stop()
    [(headers, body)] = webhook.received
    signature, secret, signed = headers["x-ezat-signature"], SECRET.encode(), sent_at(headers)
    v1 = signature.split(",")[1]
    assert verified(secret, signature, body)
    assert not verified(b"another secret", signature, body)
    assert not verified(secret, signature, body.replace(b'"0.60"', b'"0.01"'))
    # The time is signed: a captured delivery cannot be made fresh again.
    assert not verified(secret, f"t={signed + 1},{v1}", body)
    for malformed in ("", "sha256=" + "0" * 64, f"t={signed}", v1, f"t=now,{v1}", f"t={signed},v1=é"):
        assert not verified(secret, malformed, body)
    # Received again 5 minutes on, the same delivery is a replay.
    with monkeypatch.context() as later:
        later.setattr(time, "time", lambda: signed + 299)
        assert verified(secret, signature, body)
        later.setattr(time, "time", lambda: signed + 301)
        assert not verified(secret, signature, body)


async def test_an_alert_not_delivered_within_a_day_is_given_up(start_gateway, upstream, tmp_path, caplog):
    webhook = await webhook_started(failing=1_000)  # never answers but 500
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    gateway = await start_gateway(alerting_config(upstream, storage, webhook, spend_limit_usd=Decimal("1")))
    await spend_half(gateway, upstream)
    assert await after_first_attempt(storage) == [(1, "the webhook answered 500", None)]
    with sqlite3.connect(tmp_path / "ezat.db") as db:  # as if it were recorded a day and a minute ago
        db.execute("UPDATE alerts SET created_at = '2000-01-01T00:00:00.000000Z'")
    for _ in range(100):  # its next attempt is due 2 s after the first
        [(given_up, attempts)] = await query(storage, "SELECT given_up_at IS NOT NULL, attempts FROM alerts")
        if given_up:
            break
        await asyncio.sleep(0.05)
    assert (given_up, attempts) == (1, 1)  # given up, not tried again
    assert "1 alerts were given up: not delivered within a day" in caplog.text
    samples = await scrape(gateway.url)
    assert samples[("ezat_alerts_total", (("outcome", "given_up"),))] == 1
    await webhook.stop()


async def test_a_private_webhook_is_refused_unless_allowed(start_gateway, upstream, tmp_path):
    webhook = await webhook_started()
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    config = alerting_config(upstream, storage, webhook, spend_limit_usd=Decimal("1"))
    config = replace(config, alerts=(replace(config.alerts[0], allow_private_hosts=False),))
    gateway = await start_gateway(config)
    await spend_half(gateway, upstream)
    [(attempts, error, delivered)] = await after_first_attempt(storage)
    assert (attempts, error, delivered) == (1, "127.0.0.1 is not a public address (allow_private_hosts is off)", None)
    assert webhook.received == []
    await webhook.stop()


async def test_a_webhooks_redirect_is_not_followed(start_gateway, upstream, tmp_path):
    # A redirect could lead a signed POST to an address the public-address rule would refuse.
    webhook = await webhook_started(redirect=True)
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    gateway = await start_gateway(alerting_config(upstream, storage, webhook, spend_limit_usd=Decimal("1")))
    await spend_half(gateway, upstream)
    assert await after_first_attempt(storage) == [(1, "the webhook answered 307", None)]
    assert webhook.received == []
    await webhook.stop()


async def test_an_organizations_balance_alerts_too(start_gateway, upstream, tmp_path):
    webhook = await webhook_started()
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    config = alerting_config(upstream, storage, webhook, organization="acme")
    config = replace(config, organizations=(OrganizationConfig(name="acme", balance_usd=Decimal("1")),))
    config = replace(config, alerts=(replace(config.alerts[0], thresholds=(0.5,)),))
    gateway = await start_gateway(config)
    await spend_half(gateway, upstream)
    [alert] = await webhook.receive(1)
    assert alert["about"] == {"kind": "organization", "id": alert["about"]["id"], "name": "acme"}
    assert (alert["threshold"], alert["spent_usd"], alert["limit_usd"]) == (0.5, "0.60", "1")
    [organization] = [o for o in await gateway.app[STORE].list_organizations() if o.name == "acme"]
    assert organization.id == alert["about"]["id"]
    await webhook.stop()


async def test_two_workers_post_each_threshold_once(tmp_path, upstream):
    webhook = await webhook_started()
    alerts = f'\n[[alerts]]\nwebhook_url = "{webhook.url}"\nsecret = "{SECRET}"\nallow_private_hosts = true\n'
    alerts += '\n[logging]\nformat = "json"\n'  # access lines name the worker that answered
    served = ServeProcess(
        tmp_path,
        "gateway",
        SERVE_CONFIG,
        storage_url=f"sqlite:///{tmp_path / 'ezat.db'}",
        upstream_url=upstream.url,
        key_fields="spend_limit_usd = 0.3\n" + alerts,
    )
    upstream.enqueue(*(Scenario(**ANSWER, delay=0.05) for _ in range(20)))
    try:
        await served.start("--workers", "2")
        await both_workers_listening(served, within=15)

        async def one() -> None:  # a connection each: the kernel spreads them over the workers
            async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0) as client:
                await spend(client, 1)

        await asyncio.gather(*(one() for _ in range(20)))  # $0.30: every threshold, by both workers
        alerts_posted = await webhook.receive(3)
    finally:
        await served.stop()
        await webhook.stop()
    assert len({line["pid"] for line in access_lines(served)}) == 2  # both workers spent, and checked
    assert sorted(alert["threshold"] for alert in alerts_posted) == [0.5, 0.8, 1.0]


def test_an_alerts_entry_is_checked_when_the_config_is_read(tmp_path):
    path = tmp_path / "ezat.toml"
    path.write_text('[[alerts]]\nwebhook_url = "ftp://hooks.example.com"\nthresholds = [0.5, 1.5]\n')
    with pytest.raises(ConfigError) as error:
        load_config(path)
    problems = str(error.value)
    assert "alerts[0].webhook_url:" in problems and "alerts[0].secret:" in problems
    assert "alerts[0].thresholds[1]: expected a share of the limit above 0 and at most 1 (0.8 is 80 %)" in problems
