"""A person's whole day, in Debian's chromium driven by Playwright, with the identity provider on
another site than the gateway (localhost beside 127.0.0.1): Cat signs in through the provider and,
a member, sees only her own page; makes a key there and spends her group's weekly budget with it,
so her second key is refused; signs her command line in with `ezat-gateway login`, approving its
code in the browser, and `ezat-gateway key` prints a working key; then an admin, signed in with a
token in another window, disables her on the People page: her keys get 401, and her command line
gets no new key."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import aiohttp

from gateway.admin import device
from gateway.config import PolicyConfig
from gateway.mock.upstream import Scenario
from tests.oidc_provider import add_user, running_provider
from tests.support import make_config
from tests.test_budgets import ANSWER, ask
from tests.test_console import ADMIN, ROOT_TOKEN
from tests.test_console_oidc import CAT, oidc_config
from tests.test_login import code_shown, expire_soon, no_command_left_running, run, start  # noqa: F401 (a fixture)

WEEKLY = PolicyConfig(group="eng", budget_usd=Decimal("0.05"), budget_period="week")  # three answers, not four


async def models_status(gateway, secret: str) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}) as response:
            return response.status


async def test_a_persons_day_in_the_browser_and_on_the_command_line(
    start_gateway, upstream, tmp_path, chromium, monkeypatch
):
    from playwright.async_api import async_playwright

    monkeypatch.setattr(device, "INTERVAL", 1)  # the command line polls every second
    home = tmp_path / "home"
    home.mkdir()
    with running_provider() as provider:
        issuer = provider.replace("127.0.0.1", "localhost")
        await add_user(provider, CAT, email="cat@example.com", name="Cat", groups=["eng"])
        config = replace(
            make_config(upstream.url, f"sqlite:///{tmp_path / 'ezat.db'}"),
            admin=ADMIN,
            oidc=oidc_config(issuer),
            policies=(WEEKLY,),
        )
        gateway = await start_gateway(config, key_cache_seconds=0)
        upstream.enqueue(*(Scenario(**ANSWER) for _ in range(3)))
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=chromium)
            try:
                cat = await (await browser.new_context()).new_page()
                await cat.goto(gateway.url + "/console/sign-in")
                await cat.click('a:has-text("Sign in with your identity provider")')
                await cat.get_by_placeholder("sub").first.fill(CAT)
                await cat.get_by_role("button", name="Authorize").click()
                await cat.wait_for_url(gateway.url + "/console/me")  # a member: her own page
                assert await cat.locator("header a").all_inner_texts() == ["My page"]
                await cat.goto(gateway.url + "/console/keys")
                assert cat.url == gateway.url + "/console/me"

                # Her first key spends her weekly budget; her second is held to the same budget.
                await cat.fill('input[name="name"]', "laptop")
                await cat.click('button:has-text("Make a key")')
                laptop = await cat.locator("#secret").inner_text()
                async with gateway.client(api_key=laptop) as client:
                    assert [await ask(client) for _ in range(3)] == ["ok"] * 3
                await cat.goto(gateway.url + "/console/me")
                assert "$0.0450 of $0.0500 (90%)" in await cat.locator("main").inner_text()
                await cat.fill('input[name="name"]', "desktop")
                await cat.click('button:has-text("Make a key")')
                desktop = await cat.locator("#secret").inner_text()
                async with gateway.client(api_key=desktop) as client:
                    assert "across all your keys" in await ask(client)

                # Her command line: `login` shows a code, she approves it in the browser.
                login = await start(home, "login", "--gateway", gateway.url)
                shown = await code_shown(login)
                await cat.goto(shown.group(3))  # the complete verification URL, the code filled in
                await cat.click('button:has-text("Approve")')
                assert "signed in" in (await cat.locator("main").inner_text()).lower()
                assert await login.wait() == 0
                status, printed, _ = await run(home, "key", "--gateway", gateway.url)
                assert status == 0 and await models_status(gateway, printed.strip()) == 200

                # An admin disables her, from the People page in a window of their own.
                admin = await (await browser.new_context()).new_page()
                await admin.goto(gateway.url + "/console/sign-in")
                await admin.fill('input[name="token"]', ROOT_TOKEN)
                await admin.click('button:has-text("Sign in")')
                await admin.click('header a:has-text("People")')
                row = admin.locator("tr", has_text="cat@example.com")
                await row.locator('button:has-text("Disable")').click()
                await admin.wait_for_url(gateway.url + "/console/people")
                assert "disabled" in await admin.locator("tr", has_text="cat@example.com").inner_text()
            finally:
                await browser.close()
        for secret in (laptop, desktop, printed.strip()):
            assert await models_status(gateway, secret) == 401
        expire_soon(home, gateway.url)
        status, printed, said = await run(home, "key", "--gateway", gateway.url)
        assert status == 1 and printed == "" and "disabled" in said
