"""A store that cannot be reached, under load: a PostgreSQL of the test's own is stopped under an
`ezat-gateway serve` process and started again. While it is down, every route answers 503 with
`retry-after` in its API's envelope (never a 500); the log says so once as it starts and once as
it ends, with how many requests were refused, and holds no traceback; a metric counts the
refusals; and the gateway serves again once the database is back."""

from __future__ import annotations

import asyncio
import glob
import hashlib
import html
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from anthropic.types import MessageParam

from tests.conftest import _unavailable
from tests.support import KEY, MODEL, SERVE_CONFIG, ServeProcess, free_port
from tests.test_console import Browserless

COUNT_KEY = "sk-count-key"  # looked up only once the database is down: no cached lookup hides the outage
ADMIN_TOKEN = "ezat-admin-store-down-test"
CLIENTS = 4  # concurrent clients of the load
MESSAGE = "The gateway's database is unavailable"

EXTRA_CONFIG = f"""
[[keys]]
key = "{COUNT_KEY}"
name = "counter"

[admin]
session_key = "{"ab" * 32}"

[[admin.tokens]]
name = "ops"
role = "admin"
token_sha256 = "{hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()}"
"""


class OwnPostgres:
    """A PostgreSQL server in a temporary folder on a free loopback port, which the test may stop
    and start. As root it runs as the `postgres` user (initdb refuses root)."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            raise FileNotFoundError("no /usr/lib/postgresql/*/bin/initdb")
        self.bin = Path(found[-1]).parent
        self.folder = Path(tempfile.mkdtemp(prefix="ezat-store-down-"))
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.folder, user.pw_uid, user.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=60)

    def initdb(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.folder / "data"), "-A", "trust", "-U", "postgres", "-N")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        data, log = str(self.folder / "data"), str(self.folder / "server.log")
        self._run(str(self.bin / "pg_ctl"), "-D", data, "-o", options, "-l", log, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.folder / "data"), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        try:
            self.stop("immediate")
        except (OSError, subprocess.SubprocessError):
            pass  # not running
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def own_postgres():
    try:
        server = OwnPostgres()
    except (OSError, KeyError) as exc:  # no binaries, or no `postgres` user to run them as
        _unavailable("A PostgreSQL of the test's own", exc)
    try:
        server.initdb()
        server.start()
    except (OSError, subprocess.SubprocessError) as exc:
        server.remove()
        _unavailable("A PostgreSQL of the test's own", exc)
    yield server
    server.remove()


class Answers:
    """What the test's requests got: each status, and every 503's retry-after."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.unavailable_without_retry_after = 0

    def got(self, status: int, headers) -> None:
        self.statuses.append(status)
        if status == 503 and not headers.get("retry-after"):
            self.unavailable_without_retry_after += 1


async def load(gateway: ServeProcess, answers: Answers, stop: asyncio.Event) -> None:
    """One client asking for chat completions, one after another, until `stop` (at most 2,000)."""
    async with gateway.client() as client:
        for _ in range(2000):
            if stop.is_set():
                return
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
                )
                answers.got(raw.status_code, raw.headers)
            except openai.APIStatusError as exc:
                answers.got(exc.status_code, exc.response.headers)
                if exc.status_code == 503:
                    assert exc.code == "store_unavailable" and MESSAGE in exc.message, exc.body
                    await asyncio.sleep(0.05)


async def every_api(
    gateway: ServeProcess, http: aiohttp.ClientSession, console: Browserless, answers: Answers
) -> dict[str, int]:
    """One request on each route (chat completions, messages, count_tokens, the admin API, the
    console): the status each got, each checked for its API's envelope when it is a 503."""
    statuses = {"chat": await chat(gateway, answers)}
    statuses["messages"] = await messages(gateway, KEY, answers, count=False)
    statuses["count_tokens"] = await messages(gateway, COUNT_KEY, answers, count=True)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with http.get(gateway.url + "/admin/v1/keys", headers=admin) as response:
        statuses["admin"] = response.status
        answers.got(response.status, response.headers)
        if response.status == 503:
            error = (await response.json())["error"]
            assert error["code"] == "store_unavailable" and MESSAGE in error["message"], error
    status, page, headers = await console.call("GET", "/console")  # signed in
    statuses["console"] = status
    answers.got(status, headers)
    if status == 503:
        assert headers["Content-Type"].startswith("text/html") and MESSAGE in html.unescape(page), page
    return statuses


async def chat(gateway: ServeProcess, answers: Answers) -> int:
    """A chat completion with the OpenAI SDK: its status; a 503 in OpenAI's envelope."""
    async with gateway.client() as client:
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        except openai.APIStatusError as exc:
            answers.got(exc.status_code, exc.response.headers)
            body: Any = exc.body
            assert body["code"] == "store_unavailable" and body["type"] == "server_error", body
            assert MESSAGE in body["message"]
            return exc.status_code
        answers.got(raw.status_code, raw.headers)
        return raw.status_code


async def messages(gateway: ServeProcess, key: str, answers: Answers, *, count: bool) -> int:
    """A message (or, with `count`, a count of its tokens) with Anthropic's SDK: its status; a 503
    in Anthropic's envelope."""
    async with anthropic.AsyncAnthropic(base_url=gateway.url + "/anthropic", api_key=key, max_retries=0) as client:
        said: list[MessageParam] = [{"role": "user", "content": "hi"}]
        try:
            if count:
                raw: Any = await client.messages.with_raw_response.count_tokens(model=MODEL, messages=said)
            else:
                raw = await client.messages.with_raw_response.create(model=MODEL, messages=said, max_tokens=8)
        except anthropic.APIStatusError as exc:
            answers.got(exc.status_code, exc.response.headers)
            body: Any = exc.body
            assert body["type"] == "error" and body["error"]["type"] == "api_error", body
            assert MESSAGE in body["error"]["message"] and body["request_id"]
            return exc.status_code
        answers.got(raw.status_code, raw.headers)
        return raw.status_code


async def until(condition, answers: Answers, seconds: float = 10) -> None:
    """Returns once `condition()` holds, checked every tenth of a second for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, answers.statuses[-20:]
        await asyncio.sleep(0.1)


async def readyz(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/readyz") as response:
        return response.status


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as response:
        found = re.search(rf"^{name} (\S+)$", await response.text(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def test_a_database_down_is_a_503_on_every_route_logged_once(own_postgres, upstream, tmp_path):
    gateway = ServeProcess(
        tmp_path,
        config=SERVE_CONFIG + EXTRA_CONFIG,
        storage_url=own_postgres.url,
        upstream_url=upstream.url,
        key_fields="spend_limit_usd = 100",  # admission holds spend in the database on each request
    )
    await gateway.start()
    answers, stop = Answers(), asyncio.Event()
    try:
        async with aiohttp.ClientSession() as http:
            console = Browserless(gateway.url)
            assert (await console.sign_in(ADMIN_TOKEN))[0] == 303
            clients = [asyncio.create_task(load(gateway, answers, stop)) for _ in range(CLIENTS)]
            await until(lambda: answers.statuses.count(200) >= 20, answers)
            assert set(answers.statuses) == {200}, answers.statuses

            # Down: the database stops under the load.
            await asyncio.to_thread(own_postgres.stop)
            assert await readyz(http, gateway.url) == 503
            await asyncio.sleep(1.0)
            down = await every_api(gateway, http, console, answers)
            assert down == dict.fromkeys(("chat", "messages", "count_tokens", "admin", "console"), 503), down

            # Back: the database starts again, and the gateway serves within a few seconds.
            await asyncio.to_thread(own_postgres.start)
            deadline = time.monotonic() + 10
            while await readyz(http, gateway.url) != 200 or answers.statuses[-CLIENTS:] != [200] * CLIENTS:
                assert time.monotonic() < deadline, answers.statuses[-20:]
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.gather(*clients)
            up = await every_api(gateway, http, console, answers)
            assert up == dict(chat=200, messages=200, count_tokens=200, admin=200, console=200), up

            refused = answers.statuses.count(503)
            assert refused > 0 and set(answers.statuses) == {200, 503}, sorted(set(answers.statuses))
            assert answers.unavailable_without_retry_after == 0
            # Every refusal is counted: once the watch has seen the database back, the log has
            # told the outage's end, with the same count.
            deadline = time.monotonic() + 5
            while "answers again" not in gateway.output():
                assert time.monotonic() < deadline, gateway.output()
                await asyncio.sleep(0.1)
            assert await metric(http, gateway.url, "ezat_store_unavailable_total") == refused
    finally:
        stop.set()
        await gateway.stop()
    log = gateway.log.read_text()
    began = [line for line in log.splitlines() if "database is unavailable" in line]
    ended = [line for line in log.splitlines() if "database answers again" in line]
    assert len(began) == 1 and len(ended) == 1, log[-6000:]
    assert f"; {refused} requests were refused meanwhile" in ended[0], ended[0]
    assert "Traceback" not in log and "unexpected error" not in log, log[-6000:]
