"""Makes console-overview.png beside this file, docs/admin.md's picture of the console's overview:
a gateway on loopback with a month of made-up spend (in SQLite in a temporary folder), signed in
and photographed by Debian's chromium, driven by Playwright as tests/test_console.py drives it.
The clock is fixed (the app's `now`) and the spend drawn from a seeded generator, so every run makes the
same picture. `make docs-images` runs it; it needs /usr/bin/chromium (apt-get install chromium)."""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

from aiohttp import web
from playwright.async_api import async_playwright

from gateway.app import build_app
from gateway.config import parse_config
from gateway.server import app_runner
from gateway.storage import LedgerRow, open_store

PICTURE = Path(__file__).with_name("console-overview.png")
CHROMIUM = "/usr/bin/chromium"
NOW = datetime(2026, 11, 20, 15, 30, tzinfo=UTC)
TOKEN = "ezat-admin-docs-picture-token"
KEYS = ("ci", "support-bot", "notebooks")
# Each model's share of the requests, and a request's cost at most (USD).
MODELS = {"anthropic/claude-sonnet-5-5": (3, Decimal("0.60")), "anthropic/claude-haiku-5": (5, Decimal("0.08"))}


def config_text(database: Path) -> str:
    """A config of one deployment (never called: the console reads the ledger), MODELS, KEYS and
    the admin token TOKEN, with its store at `database`."""
    models = "".join(
        f'[[models]]\nid = "{model}"\ndeployments = ["anthropic"]\npricing = {{ input = 3.0, output = 15.0, cache_write = 3.75, cache_read = 0.30 }}\n\n'
        for model in MODELS
    )
    keys = "".join(f'[[keys]]\nname = "{name}"\nkey_sha256 = "{sha256(name)}"\n\n' for name in KEYS)
    return (
        f'[storage]\nurl = "sqlite:///{database}"\n\n'
        '[[deployments]]\nname = "anthropic"\nbase_url = "http://127.0.0.1:9"\n\n'
        f"{models}{keys}"
        f'[admin]\n\n[[admin.tokens]]\nname = "root"\nrole = "admin"\ntoken_sha256 = "{sha256(TOKEN)}"\n'
    )


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def ledger(key_ids: list[int]) -> list[LedgerRow]:
    """Thirty days of requests: most days busy, some quiet, from each key to each model."""
    chance = random.Random(40)
    rows = []
    for day in range(30):
        for n in range(chance.choice((0, 2, 4, 6, 9))):
            model = chance.choices(list(MODELS), weights=[share for share, _ in MODELS.values()])[0]
            finished = NOW - timedelta(days=day, minutes=chance.randrange(24 * 60))
            cost = (MODELS[model][1] * Decimal(chance.randrange(5, 101)) / 100).quantize(Decimal("0.0001"))
            rows.append(
                LedgerRow(
                    request_id=f"req_docs_{day}_{n}",
                    key_id=chance.choice(key_ids),
                    model=model,
                    answered_model=model,
                    deployment="anthropic",
                    input_tokens=chance.randrange(500, 20000),
                    cache_write_tokens=0,
                    cache_read_tokens=chance.randrange(0, 10000),
                    output_tokens=chance.randrange(50, 2000),
                    reasoning_tokens=0,
                    cost_usd=cost,
                    outcome="complete",
                    started_at=finished - timedelta(seconds=chance.randrange(1, 30)),
                    finished_at=finished,
                )
            )
    return rows


async def photograph(folder: Path) -> None:
    config = parse_config(config_text(folder / "ezat.db"))
    runner = app_runner(build_app(config, now=lambda: NOW), config.server)  # the plot's thirty days
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        store = open_store(config.storage.url)  # a second connection, as the CLI's
        await store.open()
        try:
            await store.write_ledger(ledger([key.id for key in await store.list_keys()]))
        finally:
            await store.close()
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM)
            try:
                page = await browser.new_page(viewport={"width": 1180, "height": 900})
                await page.goto(url + "/console/sign-in")
                await page.fill('input[name="token"]', TOKEN)
                await page.click('button:has-text("Sign in")')
                await page.wait_for_url(url + "/console")
                await page.screenshot(path=str(PICTURE), full_page=True)
            finally:
                await browser.close()
    finally:
        await runner.cleanup()


def main() -> None:
    if not Path(CHROMIUM).exists():
        sys.exit(f"{CHROMIUM} is missing: apt-get install chromium (as root)")
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(photograph(Path(folder)))
    print(f"wrote {PICTURE}")


if __name__ == "__main__":
    main()
