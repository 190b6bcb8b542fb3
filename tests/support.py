"""What the tests share: the test config, a gateway served on loopback (in this process, or as a
real `ezat-gateway serve` process), and the helpers several test files use."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import sys
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import aiohttp
import openai
from aiohttp import web
from yarl import URL

from gateway.config import Config, Deployment, KeyConfig, Model, Pricing, ServerConfig, StorageConfig
from gateway.server import app_runner
from gateway.storage import KeyRecord, LedgerRow, open_store
from middlewares.core import stage

KEY = "sk-test-key"
MODEL = "anthropic/claude-sonnet-5-5"
UPSTREAM_MODEL = "claude-sonnet-5-5"
UPSTREAM_KEY = "upstream-secret"

COMMAND = str(Path(sys.executable).with_name("ezat-gateway"))
"""The installed `ezat-gateway` console script, beside this virtualenv's Python."""

SERVE_CONFIG = """
[server]
host = "127.0.0.1"
port = {port}
shutdown_timeout_seconds = 10

[storage]
url = "{storage_url}"

[ratelimit]
url = "{ratelimit_url}"

[[deployments]]
name = "mock"
base_url = "{upstream_url}"
api_key = "{upstream_key}"

[[models]]
id = "{model}"
upstream_model = "{upstream_model}"
deployments = ["mock"]
pricing = {{ input = 3.0, output = 15.0, cache_write = 3.75, cache_read = 0.30 }}

[[keys]]
key = "{key}"
name = "test"
{key_fields}
"""
"""An `ezat-gateway serve` config for ServeProcess: one deployment (`upstream_url`) of the test
model, the test key (plus `key_fields`, TOML lines), the store at `storage_url` and the rate
limiter at `ratelimit_url` (empty: in memory)."""


def make_config(upstream_url: str, storage_url: str = "sqlite:///:memory:", **model_fields) -> Config:
    model = Model(
        id=MODEL,
        upstream_model=UPSTREAM_MODEL,
        deployments=("primary",),
        max_output_tokens=model_fields.pop("max_output_tokens", 64000),
        pricing=Pricing(Decimal("3"), Decimal("15"), Decimal("3.75"), Decimal("0.30")),
        **model_fields,
    )
    small = Model(id="test/small", upstream_model="small-1", deployments=("primary",), max_output_tokens=4096)
    return Config(
        storage=StorageConfig(url=storage_url),
        deployments=(Deployment(name="primary", base_url=upstream_url, api_key=UPSTREAM_KEY),),
        models=(model, small),
        keys=(KeyConfig(name="test", key_sha256=hashlib.sha256(KEY.encode()).hexdigest()),),
    )


class SetClock:
    """The gateway's idea of now for budget periods, as a test sets it and moves it (build_app's
    and open_store's `now`)."""

    def __init__(self, moment: str) -> None:
        self.set(moment)

    def set(self, moment: str) -> None:
        """Now is `moment`, an ISO 8601 instant in UTC."""
        self.moment = datetime.fromisoformat(moment)

    def __call__(self) -> datetime:
        return self.moment


def free_port() -> int:
    """A loopback port nothing listens on (for a server a test starts as a process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """A gateway app served on a free loopback port, exactly as `ezat-gateway serve` runs it (with
    `server`'s timeouts: its config's, or the defaults)."""

    def __init__(self, app: web.Application, server: ServerConfig = ServerConfig()) -> None:
        self.app = app
        self.runner = app_runner(app, server)
        self.url = ""

    async def start(self) -> Gateway:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", KEY)
        return openai.AsyncOpenAI(base_url=self.url + "/openai/v1", max_retries=0, **kwargs)

    def sync_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", KEY)
        return openai.OpenAI(base_url=self.url + "/openai/v1", max_retries=0, **kwargs)


async def raw_stream(gateway, body: dict | None = None) -> tuple[aiohttp.ClientResponse, list[str]]:
    """POST a streamed request with aiohttp (`body` adds to or replaces the default fields); the
    response and its SSE events (the text between blank lines)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Count"}], **(body or {})},
        ) as response:
            text = (await response.read()).decode()
    return response, [event for event in text.split("\n\n") if event]


def data(event: str) -> dict:
    """The JSON of one `data: {...}` SSE event."""
    assert event.startswith("data: "), event
    return json.loads(event[len("data: ") :])


async def read_store(url: str) -> tuple[list[LedgerRow], list[KeyRecord]]:
    """The ledger and the keys of the store at `url` (opened and closed again)."""
    store = open_store(url)
    await store.open()
    try:
        return await store.ledger(), await store.list_keys()
    finally:
        await store.close()


# --- The `ezat-gateway` command in a subprocess.


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without what would change the command's configuration (a real
    upstream key, a client key, a config path, a log format), plus `extra`."""
    unwanted = ("ANTHROPIC_API_KEY", "EZAT_API_KEY", "EZAT_CONFIG", "EZAT_LOG_FORMAT")
    return {**{k: v for k, v in os.environ.items() if k not in unwanted}, **extra}


async def spawn(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> asyncio.subprocess.Process:
    """Starts `ezat-gateway ARGS` in the clean environment (plus `env`), stdout and stderr in one pipe."""
    return await asyncio.create_subprocess_exec(
        COMMAND,
        *args,
        env=clean_environment(**(env or {})),
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def run_command(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 20
) -> tuple[int, str]:
    """Runs `ezat-gateway ARGS` to its end: (exit status, stdout and stderr)."""
    process = await spawn(*args, env=env, cwd=cwd)
    output, _ = await asyncio.wait_for(process.communicate(), timeout)
    return process.returncode, output.decode()


class ServeProcess:
    """One `ezat-gateway serve [--config FILE] [ARGS]` process on a free loopback port, run in
    `directory` with the clean environment (plus `env`), its output kept in a file (a pipe nobody
    reads would fill up and stall the server under load).

    `config`, when given, is TOML text (SERVE_CONFIG, say): formatted with `port`, the shared test
    values (`key`, `model`, `upstream_key`, `upstream_model`, an empty `ratelimit_url` and
    `key_fields`) and `fields`, it is written to DIRECTORY/NAME.toml.
    Without it the command runs on its embedded defaults (pass `--port` in `start`'s arguments)."""

    def __init__(
        self,
        directory: Path,
        name: str = "gateway",
        config: str | None = None,
        *,
        env: dict[str, str] | None = None,
        **fields: object,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.directory = directory
        self.config: Path | None = None
        if config is not None:
            self.config = directory / f"{name}.toml"
            values = dict(
                key=KEY,
                model=MODEL,
                upstream_key=UPSTREAM_KEY,
                upstream_model=UPSTREAM_MODEL,
                ratelimit_url="",
                key_fields="",
            )
            self.config.write_text(config.format(**{**values, **fields, "port": self.port}))
        self.log = directory / f"{name}.log"
        self.env = env or {}
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, *args: str, wait: bool = True) -> ServeProcess:
        """Starts the process; with `wait`, returns once /healthz answers."""
        config = ["--config", str(self.config)] if self.config is not None else []
        with self.log.open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                COMMAND,
                "serve",
                *config,
                *args,
                env=clean_environment(**self.env),
                cwd=self.directory,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )
        if wait:
            await self.wait_until_up()
        return self

    async def wait_until_up(self) -> None:
        async with aiohttp.ClientSession() as http:
            for _ in range(300):  # 15 s at most
                assert self.process.returncode is None, f"the gateway exited:\n{self.output()}"
                try:
                    async with http.get(self.url + "/healthz") as response:
                        if response.status < 500:
                            return
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
        raise AssertionError(f"{self.url} never came up:\n{self.output()}")

    def client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", KEY)
        return openai.AsyncOpenAI(base_url=self.url + "/openai/v1", max_retries=0, **kwargs)

    def output(self) -> str:
        """The end of the process's output so far (for failure messages)."""
        return self.log.read_text(errors="replace")[-8000:] if self.log.exists() else ""

    async def kill(self) -> None:
        """SIGKILL, and wait for the process to end."""
        self.process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.process.wait(), 10)

    async def stop(self) -> None:
        """Always safe (finally blocks): SIGTERM, then SIGKILL if it does not end in time."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), 15)
        except TimeoutError:
            self.process.kill()
            await asyncio.wait_for(self.process.wait(), 10)


class Link:
    """A TCP link to a server (PostgreSQL, say) that a test can cut: every byte passes through
    untouched until `cut()` aborts the connections and refuses new ones (an outage), or until a
    chunk holding `cut_after_sending` reaches the server, which aborts that client's connection
    right after (the server got it; its answer is lost). `reply_delay`: seconds each chunk of the
    server's answers is held back (a slow server); `arrived(needle)`: an event set once a chunk
    holding `needle` has reached the server."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.up = True
        self.cut_after_sending: bytes | None = None
        self.reply_delay = 0.0
        self._arrivals: dict[bytes, asyncio.Event] = {}
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()

    def arrived(self, needle: bytes) -> asyncio.Event:
        """Set once a chunk holding `needle` reaches the server, from now on."""
        self._arrivals[needle] = asyncio.Event()
        return self._arrivals[needle]

    async def start(self) -> Link:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def url(self, url: str) -> str:
        """`url` with its host and port replaced by the link's."""
        return str(URL(url).with_host("127.0.0.1").with_port(self.port))

    def cut(self) -> None:
        self.up = False
        for client, server in list(self._pairs):
            client.transport.abort()
            server.transport.abort()

    def restore(self) -> None:
        self.up = True

    async def close(self) -> None:
        self.cut()
        self._server.close()
        await self._server.wait_closed()

    async def _connect(self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        try:
            if not self.up:
                raise ConnectionRefusedError
            server_reader, server = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            client.transport.abort()
            return
        pair = (client, server)
        self._pairs.add(pair)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    if writer is client and self.reply_delay:
                        await asyncio.sleep(self.reply_delay)
                    writer.write(data)
                    await writer.drain()
                    if writer is server:
                        for needle, event in self._arrivals.items():
                            if needle in data:
                                event.set()
                    if writer is server and self.cut_after_sending and self.cut_after_sending in data:
                        self.cut_after_sending = None
                        client.transport.abort()
                        return
            except OSError:
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_reader, server), pipe(server_reader, client))
        self._pairs.discard(pair)


def setting(name: str, key: web.RequestKey, value: object):
    """A foreign app's stage that sets `key` to `value` on every request (its own admission)."""

    @stage(name, provides=(key,))
    async def set_it(request: web.Request, handler) -> web.StreamResponse:
        request[key] = value
        return await handler(request)

    return set_it


async def served(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` served on a free loopback port: its runner (clean it up) and its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
