"""`ezat-gateway`: serve, check-config, keys, orgs, usage, admin-tokens, audit, mock-upstream, login, key."""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import sqlite3
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path

import asyncpg
from aiohttp import web

from gateway import clock, login, version
from gateway.admin import commands as admin_commands
from gateway.app import READINESS, build_app
from gateway.config import (
    LOG_FORMATS,
    REASONING_KEY_BYTES,
    Config,
    ConfigError,
    Deployment,
    KeyConfig,
    LoggingConfig,
    Model,
    Pricing,
    ResponsesConfig,
    StorageConfig,
    expired_keys,
    load_config,
    load_storage_config,
    placeholder_digests,
    reasoning_key_bytes,
    shared_upstream_models,
    storage_url_problem,
    unshared_reasoning_key,
)
from gateway.ops.logs import configure_logging
from gateway.ops.metrics import MULTIPROCESS_DIR
from gateway.ops.tracing import Tracing, TracingUnavailable
from gateway.runtime import run, tune_garbage_collector, until_stopped
from gateway.server import LISTEN_BACKLOG, CannotListen, app_runner, bound_sockets

log = logging.getLogger("ezat")

LOCAL_KEY_FILE = "ezat-gateway.key"
REASONING_KEY_FILE = "ezat-reasoning.key"  # the demo's [responses] reasoning_key
LOG_FORMAT_ENV = "EZAT_LOG_FORMAT"  # the log's format when --log-format is not given
# Not the config's default (ezat-gateway.db): the config file is its keys' source of truth, so a
# demo and a config sharing one database would each revoke the other's keys on starting.
DEMO_STORAGE = StorageConfig(url="sqlite:///ezat-demo.db")
DEFAULT_MODEL = Model(
    id="anthropic/claude-sonnet-5-5",
    upstream_model="claude-sonnet-5-5",
    deployments=("anthropic",),
    max_output_tokens=64000,
    pricing=Pricing(Decimal("3"), Decimal("15"), Decimal("3.75"), Decimal("0.30")),
)


MOCK_PROVIDERS = ("anthropic", "bedrock", "vertex")
# The embedded model's id on each cloud's mock: a cross-region inference profile on Bedrock, a
# versioned id on Vertex AI, as those clouds name Claude.
DEMO_CLOUD_MODELS = {"bedrock": "us.anthropic.claude-sonnet-5-5-v1:0", "vertex": "claude-sonnet-5-5@20261001"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ezat-gateway", description=__doc__)
    parser.add_argument("--version", action=_PrintVersion, help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    config_option = argparse.ArgumentParser(add_help=False)
    config_option.add_argument(
        "--config", default=os.environ.get("EZAT_CONFIG"), help="TOML config file (default: $EZAT_CONFIG)"
    )
    storage_options = argparse.ArgumentParser(add_help=False, parents=[config_option])
    storage_options.add_argument(
        "--storage", help=f"storage URL (default: the config's [storage], else the demo's {DEMO_STORAGE.url})"
    )

    serving = commands.add_parser("serve", parents=[config_option], help="run the gateway")
    serving.add_argument("--host", help="override [server] host")
    serving.add_argument("--port", type=_port, help="override [server] port")
    serving.add_argument("--workers", type=_workers, help="override [server] workers (processes sharing the port)")
    serving.add_argument("--log-format", choices=LOG_FORMATS, help=f"override [logging] format and ${LOG_FORMAT_ENV}")
    serving.add_argument(
        "--mock-provider",
        choices=MOCK_PROVIDERS,
        help="without --config: answer with the built-in mock of this provider's API "
        "(default: Anthropic's API with $ANTHROPIC_API_KEY, else its mock)",
    )

    check = commands.add_parser("check-config", help="validate a config file and list its problems")
    check.add_argument("file")

    mock = commands.add_parser("mock-upstream", help="run the mock upstream: Anthropic's API, Bedrock's or Vertex AI's")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=_port, default=8081)
    mock.add_argument(
        "--provider",
        choices=MOCK_PROVIDERS,
        default="anthropic",
        help="the API it speaks; bedrock and vertex print the credentials they accept",
    )

    admin_commands.add_commands(commands, storage_options)

    gateway_option = argparse.ArgumentParser(add_help=False)
    gateway_option.add_argument(
        "--gateway",
        metavar="URL",
        help=f"the gateway's URL, e.g. https://gateway.example.com (default: ${login.GATEWAY_ENV})",
    )
    signing_in: dict[str, argparse.ArgumentParser] = {}  # their parsers, for their usage errors
    signing_in["login"] = commands.add_parser(
        "login",
        parents=[gateway_option],
        help="sign in through the gateway's console (your identity provider) and save a key of your own",
    )
    signing_in["key"] = commands.add_parser(
        "key",
        parents=[gateway_option],
        help="print the key `login` saved, renewed first when it is about to expire (Claude Code's apiKeyHelper)",
    )

    args = parser.parse_args(argv)
    # The environment's format is every command's, over the config's: an image can set it once.
    log_format = getattr(args, "log_format", None) or os.environ.get(LOG_FORMAT_ENV) or None
    if log_format not in (None, *LOG_FORMATS):
        parser.error(f"{LOG_FORMAT_ENV}: expected text or json, not {log_format!r}")
    configure_logging(LoggingConfig(format=log_format or "text"))  # serve's config may say otherwise
    if args.command in signing_in:
        gateway = _gateway(signing_in[args.command], args.gateway)
        return login.login_command(gateway) if args.command == "login" else login.key_command(gateway)
    try:
        if args.command == "check-config":
            return check_config(args.file)
        if args.command == "mock-upstream":
            from gateway.mock import bedrock, upstream, vertex

            runs: dict[str, Callable[[str, int], None]] = {"bedrock": bedrock.run, "vertex": vertex.run}
            run = runs.get(args.provider, upstream.run)
            try:
                run(args.host, args.port)  # it says it listens only once it does
            except OSError as error:  # the only thing it does that the system may refuse
                raise CannotListen(args.host, args.port, error) from None
            return 0
        if args.command in ("keys", "orgs", "usage", "admin-tokens", "audit"):
            # Only [storage]: listing keys must not need the upstream's secret in the environment.
            storage = args.storage or (load_storage_config(args.config) if args.config else DEMO_STORAGE).url
            if problem := storage_url_problem(storage):
                print(f"--storage: {problem}", file=sys.stderr)  # not the URL: it may hold a password
                return 2
            named_by = "--storage" if args.storage else "--config" if args.config else ""
            try:
                return asyncio.run(admin_commands.run(args, storage, named_by=named_by))
            except SAID_IN_ONE_LINE as exc:  # which database, since the reason rarely says
                print(
                    f"ezat-gateway {args.command}: {admin_commands.describe_storage(storage)}: {_reason(exc)}",
                    file=sys.stderr,
                )
                return 1
        if args.command == "serve" and args.mock_provider and args.config:
            parser.error("--mock-provider is for the embedded defaults: not with --config (or $EZAT_CONFIG)")
        serve(args.config, Overrides(args.host, args.port, args.workers, log_format, args.mock_provider))
    except ConfigError as exc:
        print(f"{args.config}: invalid config", *exc.problems, sep="\n  ", file=sys.stderr)
        return 1
    except TracingUnavailable as exc:
        print(f"ezat-gateway serve: {exc}", file=sys.stderr)
        return 1
    # A port taken, a database out of reach or refusing.
    except (CannotListen, *SAID_IN_ONE_LINE) as exc:
        print(f"ezat-gateway {args.command}: {_reason(exc)}", file=sys.stderr)
        return 1
    return 0


# What the system or a database refuses a command: its message is the whole story, not a traceback.
SAID_IN_ONE_LINE = (OSError, sqlite3.Error, asyncpg.PostgresError, asyncpg.InterfaceError)


def _reason(exc: BaseException) -> str:
    """An error's message for people: an OSError's without Python's "[Errno 13]" in front."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)


def _gateway(parser: argparse.ArgumentParser, given: str | None) -> str:
    """`login`'s and `key`'s gateway: --gateway's URL, else $EZAT_GATEWAY's, normalised."""
    text, source = (given, "--gateway") if given else (os.environ.get(login.GATEWAY_ENV), f"${login.GATEWAY_ENV}")
    if not text:
        parser.error(f"--gateway URL (or ${login.GATEWAY_ENV}) is needed: the gateway to sign in to")
    try:
        return login.normalised_gateway(text)
    except ValueError as exc:
        parser.error(f"{source}: {exc}")


class _PrintVersion(argparse.Action):
    """`--version`: argparse's own action needs the text up front, and reading the package's
    metadata is work every other command would pay for."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog} {version()}")  # on stdout, as argparse's own version action prints
        parser.exit()


_port = admin_commands.whole_number(1, 65535)
_workers = admin_commands.whole_number(1, 1024)


def check_config(path: str) -> int:
    try:
        config = load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem)
        return 1
    counts = ", ".join(
        _how_many(len(entries), noun)
        for entries, noun in ((config.deployments, "deployment"), (config.models, "model"), (config.keys, "key"))
    )
    print(f"{path}: ok ({counts})")
    # Valid, so not a failure, but worth a look.
    for warning in [
        *placeholder_digests(config),
        *expired_keys(config),
        *shared_upstream_models(config),
        *unshared_reasoning_key(config),
    ]:
        print(warning)
    return 0


def _how_many(count: int, noun: str) -> str:
    """ "1 key", "0 keys", "2 keys"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@dataclass(frozen=True)
class Overrides:
    """What `serve`'s options change in the config."""

    host: str | None = None
    port: int | None = None
    workers: int | None = None
    log_format: str | None = None
    mock_provider: str | None = None  # the embedded defaults' upstream: the built-in mock of this provider

    def applied(self, config: Config) -> Config:
        server = replace(
            config.server,
            host=self.host or config.server.host,
            port=self.port or config.server.port,
            workers=self.workers or config.server.workers,
        )
        logging_config = replace(config.logging, format=self.log_format or config.logging.format)
        return replace(config, server=server, logging=logging_config)


def serve(config_path: str | None, overrides: Overrides) -> None:
    """Run the gateway until SIGTERM or Ctrl-C; with several workers, one process each, sharing
    the port (SO_REUSEPORT lets the kernel spread connections over them). The config is loaded
    here once, and handed to the workers: a bad file is one message, not one per worker."""
    config = overrides.applied(load_config(config_path)) if config_path else None
    if config is not None:
        Tracing.require_sdk(config.tracing)  # one message here, not a traceback from each worker
    workers = config.server.workers if config else (overrides.workers or 1)
    if workers == 1:
        run(serve_forever(config, overrides))
        return
    if config is None:
        raise SystemExit("--workers needs --config: workers share its storage (the embedded mode is one process)")
    if not config.ratelimit.url and (limited := _rate_limited_keys(config)):
        # (A key given limits through the CLI is refused by each worker, on its requests.)
        raise SystemExit(
            f"--workers {workers} needs [ratelimit] url (Redis) for keys with rpm, tpm or max_concurrent ({', '.join(limited)}): "
            "each worker's own buckets would let through N times their limits"
        )
    # Each worker binds the port with SO_REUSEPORT, which another process's socket with it (another
    # gateway's workers) would let them share: first the port must be free for a socket without it.
    for sock in bound_sockets(config.server.host, config.server.port):
        sock.close()
    # The workers' metrics go to one directory, so that a scrape of any of them counts all.
    metrics_dir = tempfile.mkdtemp(prefix="ezat-metrics-") if config.metrics.enabled else None
    before = os.environ.get(MULTIPROCESS_DIR)
    if metrics_dir:
        os.environ[MULTIPROCESS_DIR] = metrics_dir  # spawned workers inherit it
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=_worker, args=(config,)) for _ in range(workers)]
    for process in processes:
        process.start()

    def stop(signum, frame) -> None:  # each worker shuts down gracefully on its own SIGTERM
        for process in processes:
            if process.is_alive():
                process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while any(process.is_alive() for process in processes):
            for process in processes:
                process.join(timeout=0.5)
                if process.exitcode not in (None, 0):  # a worker that died takes the others down: fail loudly
                    stop(None, None)
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            if before is None:
                os.environ.pop(MULTIPROCESS_DIR, None)
            else:
                os.environ[MULTIPROCESS_DIR] = before
    if any(process.exitcode != 0 for process in processes):
        raise SystemExit(1)


def _rate_limited_keys(config: Config) -> list[str]:
    """The names of the config's usable keys with rpm, tpm or max_concurrent."""
    return sorted(
        {
            key.name or "(unnamed)"
            for key in config.keys
            if (key.rpm or key.tpm or key.max_concurrent) and not key.revoked
        }
    )


def _worker(config: Config) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent turns Ctrl-C into SIGTERM
    try:
        run(serve_forever(config, reuse_port=True))
    except (CannotListen, *SAID_IN_ONE_LINE) as exc:
        raise SystemExit(f"ezat-gateway serve: {_reason(exc)}") from None  # printed, and the exit status 1


async def serve_forever(config: Config | None, overrides: Overrides = Overrides(), *, reuse_port: bool = False) -> None:
    """Serve `config` (None: the embedded defaults, with `overrides`) until SIGTERM or Ctrl-C."""
    server = (config or overrides.applied(Config())).server
    # The port before anything else: one already taken is refused before the store is opened or
    # the demo's mock started, and "listening" is only ever logged by a server that listens.
    # Connections made while the app starts wait in the queue, rather than being refused.
    sockets = bound_sockets(server.host, server.port, reuse_port=reuse_port)
    try:
        for sock in sockets:
            sock.listen(LISTEN_BACKLOG)
    except OSError as error:  # another process bound it too, and listened first
        raise CannotListen(server.host, server.port, error) from None
    mock = demo_key = None
    if config is None:
        embedded, demo_key, mock = await embedded_config(overrides.mock_provider)
        config = overrides.applied(embedded)
    configure_logging(config.logging)

    # On SIGTERM: stop accepting, let open requests and streams finish (up to the shutdown
    # timeout), then close; the app's cleanup writes every ledger row still pending.
    runner = app_runner(build_app(config, now=clock.from_environment()), server)
    await runner.setup()
    tune_garbage_collector()
    for sock in sockets:
        await web.SockSite(runner, sock, backlog=LISTEN_BACKLOG).start()
    log.info("ezat-gateway listening on http://%s:%d (pid %d)", server.host, server.port, os.getpid())
    if config.admin is not None:  # else a newcomer learns of the console only from the docs
        log.info(
            "admin console at http://%s:%d/console (admin API under /admin/v1/): sign in with an admin token, "
            "one of the config's [[admin.tokens]] or one made with "
            "`ezat-gateway admin-tokens create --config FILE --name NAME --role admin`",
            server.host,
            server.port,
        )
    if demo_key:
        print(_quickstart(f"http://{server.host}:{server.port}", demo_key), flush=True)

    await until_stopped()
    runner.app[READINESS].drain()  # /readyz is 503 from now on
    if server.drain_seconds:
        log.info("shutting down: serving on for %g s while load balancers see /readyz fail", server.drain_seconds)
        await asyncio.sleep(server.drain_seconds)
    log.info("shutting down: finishing open requests (up to %g s)", server.shutdown_timeout_seconds)
    await runner.cleanup()
    if mock is not None:
        await mock.close()


async def embedded_config(mock_provider: str | None = None):
    """No config file: one model, a real Anthropic deployment when ANTHROPIC_API_KEY is set and
    the built-in mock upstream otherwise (or, with `mock_provider`, that provider's built-in mock),
    its own SQLite file in the working directory, a local key, and a reasoning key beside them."""
    mock = None
    demo_key = os.environ.get("EZAT_API_KEY") or _local_key()  # before the mock says it answers
    responses = ResponsesConfig(reasoning_key=_local_reasoning_key())
    api_key = os.environ.get("ANTHROPIC_API_KEY")
    model = DEFAULT_MODEL
    if mock_provider in ("bedrock", "vertex"):
        mock, deployment = await _cloud_mock(mock_provider)
        upstream_model = DEMO_CLOUD_MODELS[mock_provider]
        model = replace(model, deployments=(deployment.name,), upstream_models={deployment.name: upstream_model})
    elif api_key and mock_provider is None:
        deployment = Deployment(name="anthropic", base_url="https://api.anthropic.com", api_key=api_key)
    else:
        from gateway.mock.upstream import MockUpstream

        mock = MockUpstream()
        url = await mock.start()
        log.info("%s: answering with the built-in mock upstream at %s", _why_the_mock(mock_provider), url)
        deployment = Deployment(name="anthropic", base_url=url, api_key="mock")
    key = KeyConfig(name="local", key_sha256=hashlib.sha256(demo_key.encode()).hexdigest())
    config = Config(storage=DEMO_STORAGE, responses=responses, deployments=(deployment,), models=(model,), keys=(key,))
    return config, demo_key, mock


def _why_the_mock(mock_provider: str | None) -> str:
    return "--mock-provider anthropic" if mock_provider else "no ANTHROPIC_API_KEY"


async def _cloud_mock(provider: str):
    """The built-in mock of Bedrock or Vertex AI, started, and a deployment that signs in to it
    as one would to the cloud: Bedrock with an API key, Vertex AI with a service-account file."""
    if provider == "bedrock":
        from gateway.mock.bedrock import BedrockMock

        bedrock = BedrockMock(region="us-east-1")
        url = await bedrock.start()
        log.info("--mock-provider bedrock: answering with the built-in mock Amazon Bedrock at %s", url)
        deployment = Deployment(
            name="bedrock", provider="bedrock", region=bedrock.region, base_url=url, api_key=bedrock.api_key_bearer
        )
        return bedrock, deployment
    from gateway.mock.vertex import VertexMock

    vertex = VertexMock()
    url = await vertex.start()
    log.info("--mock-provider vertex: answering with the built-in mock Google Vertex AI at %s", url)
    deployment = Deployment(
        name="vertex",
        provider="vertex",
        region="us-east5",
        project=vertex.project,
        base_url=url + "/v1",
        credentials_file=str(vertex.key_file),
    )
    return vertex, deployment


def _local_key() -> str:
    """The embedded setup's key, kept beside its database so it stays the same across restarts."""
    path = Path(LOCAL_KEY_FILE)
    if path.exists():
        return path.read_text().strip()
    key = "sk-ezat-" + secrets.token_urlsafe(24)
    path.touch(mode=0o600)
    path.write_text(key + "\n")
    return key


def _local_reasoning_key() -> str:
    """The embedded setup's reasoning key, kept beside its database as its local key is, so that
    reasoning items sealed before a restart still open after it. A file holding no usable key
    (edited by hand, say) gets a new one: what the old one sealed could not be opened anyway."""
    path = Path(REASONING_KEY_FILE)
    if path.exists():
        text = path.read_text().strip()
        if reasoning_key_bytes(text) is not None:
            return text
        log.warning("%s holds no usable key (32 bytes, base64 or hex): writing a new one", REASONING_KEY_FILE)
    text = base64.b64encode(secrets.token_bytes(REASONING_KEY_BYTES)).decode()
    path.touch(mode=0o600)
    path.write_text(text + "\n")
    return text


def _quickstart(base: str, key: str) -> str:
    model = DEFAULT_MODEL.id
    return f"""
Your local key: {key}

  curl {base}/openai/v1/chat/completions \\
    -H "Authorization: Bearer {key}" -H "content-type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base}/openai/v1", api_key="{key}")
  reply = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(reply.choices[0].message.content)
"""


if __name__ == "__main__":
    sys.exit(main())
