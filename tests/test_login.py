"""`ezat-gateway login` and `ezat-gateway key`, run as a person runs them (the installed command, in
a subprocess, with a clean environment and a config folder of its own) against a real gateway on
loopback, a real OpenID provider (tests/oidc_provider.py) and a person signed in to the console
who approves the code on /console/device: the key saved and working, `key` printing it alone and
renewing it near its end, refusals said on stderr with nothing on stdout; and Claude Code and
Codex taking their key from `ezat-gateway key`, as docs/clients.md sets them up."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import stat
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest

from gateway.admin import device
from gateway.app import STORE
from gateway.mock.upstream import Scenario
from tests.oidc_provider import add_user, running_provider
from tests.support import COMMAND, MODEL, clean_environment, make_config
from tests.test_console import ADMIN, ROOT_TOKEN, Browserless, csrf
from tests.test_console_oidc import CAT, POLICIES, chat, oidc_config, signed_in_as

CODE_LINE = re.compile(r"Open (\S+) and enter ([A-Z]{4}-[A-Z]{4}) \(or open (\S+)\)")


@pytest.fixture
def issuer():
    with running_provider() as url:
        yield url


@pytest.fixture
def fast_polls(monkeypatch):
    """The gateway's device codes polled every second, not every 5 (it runs in this process)."""
    monkeypatch.setattr(device, "INTERVAL", 1)


@pytest.fixture
async def gateway(start_gateway, upstream, issuer, tmp_path, fast_polls):
    """A gateway whose people sign in through `issuer` and get keys under POLICIES; Cat (group
    "eng": 6-hour keys) is a person of the provider."""
    await add_user(issuer, CAT, email="cat@example.com", name="Cat", groups=["eng"])
    config = replace(
        make_config(upstream.url, f"sqlite:///{tmp_path / 'ezat.db'}"),
        admin=ADMIN,
        oidc=oidc_config(issuer),
        policies=POLICIES,
    )
    return await start_gateway(config, key_cache_seconds=0)


@pytest.fixture
def home(tmp_path) -> Path:
    """The person's home: HOME, and XDG_CONFIG_HOME under it."""
    home = tmp_path / "home"
    home.mkdir()
    return home


STARTED: list[asyncio.subprocess.Process] = []  # the commands a test started


@pytest.fixture(autouse=True)
async def no_command_left_running():
    """A `login` a failed test left polling is killed, not left for its 10 minutes."""
    yield
    while STARTED:
        process = STARTED.pop()
        if process.returncode is None:
            process.kill()
            await process.wait()


def environment(home: Path, **extra: str) -> dict[str, str]:
    environ = clean_environment(HOME=str(home), XDG_CONFIG_HOME=str(home / "config"), **extra)
    if "EZAT_GATEWAY" not in extra:
        environ.pop("EZAT_GATEWAY", None)  # the developer's own, if set, is not the test's
    return environ


async def start(home: Path, *args: str, **extra: str) -> asyncio.subprocess.Process:
    """`ezat-gateway ARGS` as the person runs it, stdout and stderr apart."""
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        *args,
        env=environment(home, **extra),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    STARTED.append(process)
    return process


async def run(home: Path, *args: str, **extra: str) -> tuple[int, str, str]:
    """`ezat-gateway ARGS` to its end: (exit status, stdout, stderr)."""
    process = await start(home, *args, **extra)
    out, err = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode, out.decode(), err.decode()


async def code_shown(process: asyncio.subprocess.Process) -> re.Match[str]:
    """The line `login` says where to approve in (read from its stderr)."""
    said = b""
    while True:
        line = await asyncio.wait_for(process.stderr.readline(), 30)
        assert line, f"login ended without showing a code: {said.decode()}"
        said += line
        if match := CODE_LINE.search(line.decode()):
            return match


async def on_device_page(visitor: Browserless, user_code: str, action: str = "approve") -> tuple[int, str]:
    """`action` (approve or deny) on the console's device page, as the person's browser does."""
    page = await visitor.page(f"/console/device?user_code={user_code}")
    assert user_code in page
    status, body, _ = await visitor.call(
        "POST", "/console/device", {"csrf": csrf(page), "user_code": user_code, "action": action}
    )
    return status, body


async def log_in(gateway, home: Path, sub: str = CAT) -> tuple[int, str, str]:
    """`login` from start to end, `sub` approving its code: (exit status, stdout, stderr)."""
    process = await start(home, "login", "--gateway", gateway.url + "/")
    shown = await code_shown(process)
    status, body = await on_device_page(await signed_in_as(gateway, sub), shown.group(2))
    assert status == 200, body
    out, err = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode, out.decode(), shown.group(0) + "\n" + err.decode()


def credentials_file(home: Path) -> Path:
    return home / "config" / "ezat-gateway" / "credentials.json"


def saved(home: Path) -> dict:
    return json.loads(credentials_file(home).read_text())


def expire_soon(home: Path, gateway_url: str, within: timedelta = timedelta(minutes=2)) -> None:
    """Makes the saved key's expiry near, as if hours had passed."""
    entries = saved(home)
    moment = datetime.now(UTC) + within
    entries[gateway_url]["expires_at"] = moment.strftime("%Y-%m-%dT%H:%M:%SZ")
    credentials_file(home).write_text(json.dumps(entries))


async def disable(gateway, sub: str) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ROOT_TOKEN}"}) as http:
        async with http.get(gateway.url + "/admin/v1/people") as response:
            [person] = [p["id"] for p in (await response.json())["data"] if p["subject"] == sub]
        async with http.post(gateway.url + f"/admin/v1/people/{person}/disable") as response:
            assert response.status == 200


# --- login


async def test_login_shows_the_code_and_saves_a_key_that_works(gateway, home):
    process = await start(home, "login", "--gateway", gateway.url + "/")  # the trailing slash is no other gateway
    shown = await code_shown(process)
    url, user_code, complete = shown.groups()
    assert url == gateway.url + "/console/device"
    assert complete == f"{gateway.url}/console/device?user_code={user_code}"
    assert not credentials_file(home).exists()  # nothing saved before the approval
    status, body = await on_device_page(await signed_in_as(gateway, CAT), user_code)
    assert status == 200, body
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err
    assert out == b""  # stdout is for `key`'s key alone
    assert f"Signed in to {gateway.url}: your key expires at " in err.decode()

    path = credentials_file(home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    [(url, entry)] = saved(home).items()
    assert url == gateway.url and set(entry) == {"key", "expires_at", "refresh_token"}
    assert entry["key"].startswith("sk-ezat-")
    lives = datetime.fromisoformat(entry["expires_at"]) - datetime.now(UTC)
    assert timedelta(hours=6) - timedelta(minutes=2) < lives <= timedelta(hours=6)  # Cat's policy: 6 hours
    assert entry["refresh_token"] not in err.decode() and entry["key"] not in err.decode()
    assert await chat(gateway, entry["key"]) == 200


async def test_key_prints_the_saved_key_alone(gateway, home):
    code, _, said = await log_in(gateway, home)
    assert code == 0, said
    key = saved(home)[gateway.url]["key"]
    assert await run(home, "key", "--gateway", gateway.url) == (0, key + "\n", "")
    # $EZAT_GATEWAY names it as well, with or without the trailing slash.
    assert await run(home, "key", EZAT_GATEWAY=gateway.url + "/") == (0, key + "\n", "")
    assert saved(home)[gateway.url]["key"] == key  # a key far from its end is not renewed


async def test_key_renews_a_key_about_to_expire_and_saves_the_new_refresh_token(gateway, home):
    code, _, said = await log_in(gateway, home)
    assert code == 0, said
    before = saved(home)[gateway.url]
    expire_soon(home, gateway.url)
    code, out, err = await run(home, "key", "--gateway", gateway.url)
    assert (code, err) == (0, "")
    after = saved(home)[gateway.url]
    assert out == after["key"] + "\n" and after["key"] != before["key"]
    assert after["refresh_token"] != before["refresh_token"]  # rotated: the answer's is kept
    lives = datetime.fromisoformat(after["expires_at"]) - datetime.now(UTC)
    assert lives > timedelta(hours=5)
    assert stat.S_IMODE(credentials_file(home).stat().st_mode) == 0o600
    assert await chat(gateway, after["key"]) == 200
    # Renewed once: the next `key` prints the same key.
    assert await run(home, "key", "--gateway", gateway.url) == (0, after["key"] + "\n", "")


async def test_concurrent_keys_renew_once(gateway, home):
    """Two tools asking at once (Claude Code and Codex, say): the first renews, the second waits
    for it and prints the same key, rather than spending the refresh token a second time."""
    code, _, said = await log_in(gateway, home)
    assert code == 0, said
    expire_soon(home, gateway.url)
    results = await asyncio.gather(*(run(home, "key", "--gateway", gateway.url) for _ in range(3)))
    key = saved(home)[gateway.url]["key"]
    assert results == [(0, key + "\n", "")] * 3


async def test_key_after_the_person_is_disabled_says_to_log_in_again(gateway, home):
    code, _, said = await log_in(gateway, home)
    assert code == 0, said
    await disable(gateway, CAT)
    expire_soon(home, gateway.url)
    code, out, err = await run(home, "key", "--gateway", gateway.url)
    assert (code, out) == (1, "")
    assert "refused to renew your key" in err and "disabled" in err
    assert f"ezat-gateway login --gateway {gateway.url}" in err
    assert "Traceback" not in err


async def test_a_denied_code_is_said_and_nothing_saved(gateway, home):
    process = await start(home, "login", "--gateway", gateway.url)
    shown = await code_shown(process)
    status, _ = await on_device_page(await signed_in_as(gateway, CAT), shown.group(2), "deny")
    assert status == 200
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert (process.returncode, out) == (1, b"")
    assert "denied" in err.decode() and not credentials_file(home).exists()


async def test_an_expired_code_says_to_run_login_again(gateway, home, monkeypatch):
    monkeypatch.setattr(device, "EXPIRES_IN", 2)
    code, out, err = await run(home, "login", "--gateway", gateway.url)
    assert (code, out) == (1, "")
    assert "expired" in err and f"ezat-gateway login --gateway {gateway.url}` again" in err
    assert not credentials_file(home).exists()


async def test_ctrl_c_stops_login_quietly(gateway, home):
    process = await start(home, "login", "--gateway", gateway.url)
    await code_shown(process)
    process.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert (process.returncode, out) == (130, b"")
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err
    assert not credentials_file(home).exists()


async def test_login_to_a_gateway_without_oidc_says_so(start_gateway, home):
    plain = await start_gateway()
    code, out, err = await run(home, "login", "--gateway", plain.url)
    assert (code, out) == (1, "")
    assert f"ezat-gateway login: the gateway at {plain.url}" in err and "[oidc]" in err


# --- key, without a gateway to ask


async def test_key_without_credentials_says_to_log_in(home):
    code, out, err = await run(home, "key", "--gateway", "https://gateway.example.com")
    assert (code, out) == (1, "")
    assert "not signed in to https://gateway.example.com" in err
    assert "run `ezat-gateway login --gateway https://gateway.example.com`" in err


async def test_key_with_a_gateway_that_cannot_be_reached(home):
    """A key to renew, and nothing listening where the gateway was."""
    path = credentials_file(home)
    path.parent.mkdir(parents=True)
    gone = "http://127.0.0.1:9"  # the discard port: nothing listens on it here
    soon = (datetime.now(UTC) + timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    path.write_text(json.dumps({gone: {"key": "sk-ezat-old", "expires_at": soon, "refresh_token": "ezat-renew-x"}}))
    code, out, err = await run(home, "key", "--gateway", gone)
    assert (code, out) == (1, "")
    assert f"cannot reach the gateway at {gone}" in err and "ezat-renew-x" not in err


async def test_a_file_that_is_no_credentials_file_is_said(home):
    path = credentials_file(home)
    path.parent.mkdir(parents=True)
    path.write_text("not json")
    code, out, err = await run(home, "key", "--gateway", "https://gateway.example.com")
    assert (code, out) == (1, "")
    assert f"{path} is not a credentials file" in err


@pytest.mark.parametrize(
    ("args", "extra", "said"),
    [
        (("key",), {}, "--gateway URL (or $EZAT_GATEWAY) is needed"),
        (("key", "--gateway", "gateway.example.com"), {}, "--gateway: expected the gateway's URL"),
        (("login", "--gateway", "https://gw.example.com/?x=1"), {}, "without a query"),
        (("login",), {"EZAT_GATEWAY": "ftp://gateway.example.com"}, "$EZAT_GATEWAY: expected the gateway's URL"),
    ],
)
async def test_a_missing_or_bad_gateway_is_a_usage_error(home, args, extra, said):
    code, out, err = await run(home, *args, **extra)
    assert (code, out) == (2, "") and said in err


# --- the clients, as docs/clients.md sets them up


async def test_claude_code_takes_its_key_from_ezat_gateway_key(gateway, home, upstream, claude_code):
    code, _, said = await log_in(gateway, home)
    assert code == 0, said
    key = saved(home)[gateway.url]["key"]
    (home / ".claude").mkdir()
    settings = {  # docs/clients.md's, with the installed command's path
        "apiKeyHelper": f"{COMMAND} key --gateway {gateway.url}",
        "env": {"ANTHROPIC_BASE_URL": gateway.url, "ANTHROPIC_MODEL": MODEL},
    }
    (home / ".claude" / "settings.json").write_text(json.dumps(settings))
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Hello from the mock."}]))
    process = await asyncio.create_subprocess_exec(
        str(claude_code),
        "-p",
        "Say hello",
        "--output-format",
        "json",
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / "config"),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # nothing sent anywhere but the gateway
        },
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=home,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, (out + err).decode()
    assert json.loads(out)["result"] == "Hello from the mock."
    [row] = await gateway.app[STORE].ledger()
    [record] = [k for k in await gateway.app[STORE].list_keys() if k.id == row.key_id]
    assert record.key_sha256 == hashlib.sha256(key.encode()).hexdigest()  # the key `login` saved
    assert record.name == device.KEY_NAME and record.person_id is not None


# docs/clients.md's, with the installed command's path.
CODEX_CONFIG = """\
model = "{model}"
model_provider = "ezat"

[model_providers.ezat]
name = "ezat-gateway"
base_url = "{gateway}/v1"
wire_api = "responses"

[model_providers.ezat.auth]
command = "{command}"
args = ["key", "--gateway", "{gateway}"]
refresh_interval_ms = 300000
"""


async def test_codex_takes_its_key_from_ezat_gateway_key(gateway, home, upstream, codex):
    code, _, said = await log_in(gateway, home)
    assert code == 0, said
    key = saved(home)[gateway.url]["key"]
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(model=MODEL, gateway=gateway.url, command=COMMAND))
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Hello from the mock."}]))
    process = await asyncio.create_subprocess_exec(
        str(codex),
        "exec",
        "--json",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--",
        "Say hello",
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "CODEX_HOME": str(codex_home),
            "XDG_CONFIG_HOME": str(home / "config"),
        },
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=home,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, (out + err).decode()
    events = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    said = [e["item"]["text"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    assert said == ["Hello from the mock."]
    [row] = await gateway.app[STORE].ledger()
    [record] = [k for k in await gateway.app[STORE].list_keys() if k.id == row.key_id]
    assert record.key_sha256 == hashlib.sha256(key.encode()).hexdigest()  # the key `login` saved
    assert record.name == device.KEY_NAME and record.person_id is not None
