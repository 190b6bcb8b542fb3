"""Shared fixtures: a real mock upstream and a real gateway, both on loopback."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio
import redis.exceptions
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir
from yarl import URL

from gateway.app import build_app
from gateway.config import Config
from gateway.mock.upstream import MockUpstream
from tests.support import UPSTREAM_KEY, Gateway, make_config

# Hypothesis keeps no database of examples, and its caches go to a temporary folder: tests write
# only there, never into the checkout (a failure prints the blob that reproduces it instead).
settings.register_profile("ezat", database=None)
settings.load_profile("ezat")
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "ezat-gateway-hypothesis")


@pytest.fixture
async def upstream():
    mock = MockUpstream(api_key=UPSTREAM_KEY)
    await mock.start()
    yield mock
    await mock.close()


@pytest.fixture
async def second(upstream):
    """Another deployment's mock upstream, beside `upstream`."""
    mock = MockUpstream(api_key=UPSTREAM_KEY)
    await mock.start()
    yield mock
    await mock.close()


@pytest.fixture
async def start_gateway(upstream):
    """Starts a gateway in front of `upstream`; keyword arguments go to build_app. Wherever it
    sends the client's bytes on, it proves they still make the body: a stage that changed it in
    place without `body_changed(request)` fails its request (a 500)."""
    started: list[Gateway] = []

    async def start(config: Config | None = None, **app_options) -> Gateway:
        config = config or make_config(upstream.url)
        app_options.setdefault("check_client_bytes", True)
        gateway = await Gateway(build_app(config, **app_options), config.server).start()
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        await gateway.runner.cleanup()


@pytest.fixture
async def gateway(start_gateway) -> Gateway:
    return await start_gateway()


@pytest.fixture
async def client(gateway):
    async with gateway.client() as c:
        yield c


# --- PostgreSQL and Redis: required in CI (EZAT_REQUIRE_SERVICES=1), skipped with a reason elsewhere.

POSTGRES_URL = os.environ.get("EZAT_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("EZAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def _unavailable(what: str, exc: Exception) -> None:
    if os.environ.get("EZAT_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{what} is required here (EZAT_REQUIRE_SERVICES=1) but unreachable: {exc!r}")
    pytest.skip(f"{what} is not running here ({exc!r}); CI runs these tests")


@pytest.fixture
async def postgres_url():
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    try:
        admin = await asyncpg.connect(POSTGRES_URL, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        _unavailable("PostgreSQL", exc)
    schema = "test_" + uuid.uuid4().hex[:12]
    await admin.execute(f"CREATE SCHEMA {schema}")
    separator = "&" if "?" in POSTGRES_URL else "?"
    yield f"{POSTGRES_URL}{separator}search_path={schema}"
    await admin.execute(f"DROP SCHEMA {schema} CASCADE")
    await admin.close()


@pytest.fixture
async def redis_url(worker_number):
    """A Redis URL on a database emptied before and after the test: EZAT_TEST_REDIS_URL's under
    one process, the one N below it on pytest-xdist's worker N, so workers never empty each
    other's (15, 14, ... with the default)."""
    database = int(URL(REDIS_URL).path.strip("/") or 0) - worker_number
    if database < 0:
        pytest.fail(
            f"worker {worker_number} would need Redis database {database}: give EZAT_TEST_REDIS_URL a higher one"
        )
    url = str(URL(REDIS_URL).with_path(f"/{database}"))
    client = redis.asyncio.Redis.from_url(url, socket_connect_timeout=3)
    try:
        await client.flushdb()
    except (OSError, redis.exceptions.RedisError) as exc:
        await client.aclose()
        _unavailable("Redis", exc)
    yield url
    await client.flushdb()
    await client.aclose()


@pytest.fixture(scope="session")
def worker_number() -> int:
    """pytest-xdist's number for this process (gw3: 3); 0 without -n, or without pytest-xdist at
    all (`make test-oldest` runs the stage tests without it)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker.removeprefix("gw")) if worker.startswith("gw") else 0


# --- Node.js: the official OpenAI SDK for Node.js, used by test_node_sdk.py and test_spec_examples.py,
# Claude Code, Codex CLI and the Vercel AI SDK.

# The version the tests (and the product page's examples) were last run with.
NODE_SDK = "openai@7.59.0"


@pytest.fixture(scope="session")
def node_sdk(pytestconfig) -> Path:
    """A directory whose node_modules holds NODE_SDK, installed once into the virtualenv (make
    clean removes it). Without Node.js or the npm registry these tests skip, except in CI
    (EZAT_REQUIRE_SERVICES=1), where they fail."""
    where = Path(sys.prefix) / "node-sdk"
    _npm_install(pytestconfig, NODE_SDK, where, where / "node_modules" / "openai" / "package.json")
    return where


# Claude Code, whose npm package ships a native `claude` binary (test_claude_code.py); the version
# the tests were last run with.
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"


@pytest.fixture(scope="session")
def claude_code(pytestconfig) -> Path:
    """The `claude` binary of CLAUDE_CODE, installed once into the virtualenv as NODE_SDK is."""
    where = Path(sys.prefix) / "claude-code"
    binary = where / "node_modules" / ".bin" / "claude"
    _npm_install(pytestconfig, CLAUDE_CODE, where, binary)
    return binary


# Codex CLI, whose npm package ships a native `codex` binary (test_codex.py); the version the tests
# were last run with.
CODEX = "@openai/codex@0.171.0"


@pytest.fixture(scope="session")
def codex(pytestconfig) -> Path:
    """The `codex` binary of CODEX, installed once into the virtualenv as NODE_SDK is."""
    where = Path(sys.prefix) / "codex"
    binary = where / "node_modules" / ".bin" / "codex"
    _npm_install(pytestconfig, CODEX, where, binary)
    return binary


# The Vercel AI SDK (test_vercel_ai.py): `ai`, its OpenAI provider and zod, their peer dependency.
# The newest releases whose engines include Node.js 20 (ai 7 wants Node.js 22); the versions the
# tests were last run with.
AI_SDK = ("ai@6.0.325", "@ai-sdk/openai@3.0.141", "zod@4.1.12")


@pytest.fixture(scope="session")
def ai_sdk(pytestconfig) -> Path:
    """A directory whose node_modules holds AI_SDK, installed once into the virtualenv as NODE_SDK is."""
    where = Path(sys.prefix) / "ai-sdk"
    _npm_install(pytestconfig, AI_SDK, where, where / "node_modules" / "@ai-sdk" / "openai" / "package.json")
    return where


def _npm_install(config: pytest.Config, package: str | tuple[str, ...], where: Path, installed: Path) -> None:
    """`npm install` `package` (or several) under `where`, unless `installed` is there already; skips
    the test without Node.js or the npm registry, or fails it in CI (EZAT_REQUIRE_SERVICES=1)."""
    if installed.exists():
        return
    packages = (package,) if isinstance(package, str) else package
    package = " ".join(packages)  # for the messages
    with _one_install_at_a_time():
        if installed.exists():  # another worker installed it while this one waited
            return
        try:
            if shutil.which("node") is None or shutil.which("npm") is None:
                raise FileNotFoundError("node and npm are not both installed")
            _announce(config, f"installing {package} with npm into {where} (once; later runs reuse it)")
            subprocess.run(
                ["npm", "install", "--prefix", str(where), "--save-exact", "--no-audit", "--no-fund", *packages],
                check=True,
                capture_output=True,
                timeout=600,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            if os.environ.get("EZAT_REQUIRE_SERVICES") == "1":
                pytest.fail(f"Node.js and {package} are required here (EZAT_REQUIRE_SERVICES=1): {exc!r}")
            pytest.skip(f"Node.js with {package} is not available here ({exc!r}); CI runs these tests")


@contextlib.contextmanager
def _one_install_at_a_time():
    """Holds a lock that every run of the tests with this virtualenv shares (each pytest-xdist
    worker is a process of its own): two npm installs into one folder, or two apt-gets, would
    break each other, so the second waits for the first and then finds its work done."""
    with (Path(sys.prefix) / "tests-install.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file lets the lock go


def _announce(config: pytest.Config, line: str) -> None:
    """Writes `line` to the terminal while the test's output is captured: an npm install takes
    minutes, and a run that says nothing meanwhile looks stuck."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        if hasattr(config, "workerinput"):
            # A pytest-xdist worker: its reporter writes nowhere, its stderr to the terminal, maybe
            # after some of the progress dots.
            print(f"\n{line}", file=sys.stderr, flush=True)
        elif reporter is not None:
            if reporter._tw.width_of_current_line:  # after a run of progress dots (-q), on a line of its own
                reporter.write("\n")
            reporter.write_line(line)
        else:
            print(line, file=sys.stderr, flush=True)


@pytest.fixture(params=["memory", "redis"])
def ratelimit_url(request) -> str:
    """The rate limiter's URL: in memory (empty), then Redis, which replicas share."""
    return "" if request.param == "memory" else request.getfixturevalue("redis_url")


# --- Debian's chromium, for the console's browser test (tests/test_console.py), driven by Playwright
# by its path: Playwright's own browser builds are downloads this project does not make.

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def chromium(pytestconfig) -> str:
    """The path of Debian's chromium, installed with apt when it is missing and the tests run as
    root (CI does). Elsewhere, without it, the test skips; in CI (EZAT_REQUIRE_SERVICES=1) it fails."""
    if not Path(CHROMIUM).exists() and os.geteuid() == 0 and shutil.which("apt-get"):
        with _one_install_at_a_time():
            if not Path(CHROMIUM).exists():  # nor did another worker install it meanwhile
                _install_chromium(pytestconfig)
    if not Path(CHROMIUM).exists():
        if os.environ.get("EZAT_REQUIRE_SERVICES") == "1":
            pytest.fail(f"chromium is required here (EZAT_REQUIRE_SERVICES=1) but {CHROMIUM} is missing")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium, as root); CI runs this test")
    return CHROMIUM


def _install_chromium(config: pytest.Config) -> None:
    _announce(config, "installing chromium: apt-get install -y chromium (once)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "chromium"], env=env, check=True, capture_output=True, timeout=1200
        )
    except (OSError, subprocess.SubprocessError) as exc:
        _announce(config, f"apt-get install chromium failed: {exc!r}")
