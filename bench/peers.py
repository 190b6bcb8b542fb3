"""The peers: two other LLM gateways, each in a process of its own, driven beside ours and the
floor on the Chat Completions route (POST /v1/chat/completions) in front of the same
Anthropic-speaking mock, so that the suite can say what a request costs in each.

- **LiteLLM** (`litellm[proxy]`, Python): installed into a virtualenv of its own under
  `bench/.peers/litellm/` (never the project's), started as its `litellm` CLI with a config
  that routes each benchmark model to `anthropic/<model>` at the mock.
- **Portkey's open-source gateway** (`@portkey-ai/gateway`, Node): installed with npm under
  `bench/.peers/portkey/`, with `@hono/node-server` held at 1.13.5 (later ones fail every
  stream with `TypeError: immutable`); each request names its provider and the mock in headers.

Both are installed on first use, exact versions pinned, skipped when already there; when
PyPI or npm cannot be reached, or node is missing, `prepare` says why in one line and the
suite skips that peer saying so. `bench/.peers/` is not in git.

    .venv/bin/python bench/peers.py   # install, start each beside the mock, check every chat
                                      # scenario, and show their answers beside ours
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from systems import BENCH, PYTHON, System, free_port, listening

PEERS = ("litellm", "portkey")
PEERS_DIR = BENCH / ".peers"

# 1.108.7: the newest litellm[proxy] whose pinned companions (litellm-proxy-extras,
# litellm-enterprise) are all on PyPI; 1.108.8 and later pin releases of them not published there.
LITELLM_VERSION = "1.108.7"
PORTKEY_VERSION = "1.15.2"
# The gateway's own range (^1.3.3) takes 1.19, with which every stream fails (500, TypeError in updateHeaders).
HONO_NODE_SERVER_VERSION = "1.13.5"

INSTALL_TIMEOUT = 900  # seconds; litellm[proxy] is a large install

# What LiteLLM does unless told not to, that a production deployment turns off, so do we:
LITELLM_ENV = {
    "LITELLM_TELEMETRY_DISABLED": "true",  # its usage telemetry (a middleware records every request)
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # the price list from the package, not fetched from GitHub at start
    "DISABLE_ADMIN_UI": "True",  # no admin UI: we only serve the API
}
# Its own (verbose) logging stays at its default, off; uvicorn's access line per request stays
# on, as the gateway writes one too. `LITELLM_LOG` would set both.
LITELLM_KEY = "sk-bench-litellm"  # its master key: every request is authenticated, as in production
# Seconds of load before a peer's CPU per request settles, against the suite's 1 s warm-up:
# LiteLLM imports lazily on its first requests, and Portkey's V8 compiles its hot code under
# load, so both keep getting faster for seconds after they start (bench/HISTORY.md, 2026-12-03).
WARMUP_SECONDS = {"litellm": 6.0, "portkey": 10.0}
# The peers that download a request's image URLs, as the gateway does: Portkey sends them upstream
# as they are (a request of a few hundred bytes where ours inlines both), so the images
# scenario is not its work.
FETCHES_IMAGES = ("litellm",)
# LiteLLM imports for many seconds before it is ready, longer on a busy machine.
READY_TIMEOUT = {"litellm": 90.0, "portkey": 30.0}

# Portkey's start script (build/start-server.js) calls @hono/node-server's serve({fetch, port})
# without a hostname, so Node listens on every interface, and no argument or variable sets it.
# This module, loaded with `node --import` before the script, makes every listening socket of
# the process bind to the loopback address instead.
LOOPBACK_MJS = """\
import net from "node:net";

const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (args[0] !== null && typeof args[0] === "object") {
    args[0] = { ...args[0], host: "127.0.0.1" };
  } else if (typeof args[0] === "number" || (typeof args[0] === "string" && /^\\d+$/.test(args[0]))) {
    if (typeof args[1] === "string") args[1] = "127.0.0.1";
    else args.splice(1, args[1] === undefined ? 1 : 0, "127.0.0.1");
  }
  return listen.apply(this, args);
};
"""


@dataclass
class PeerSystem(System):
    """A peer: a System with its own time to get ready (LiteLLM imports a lot)."""

    ready_timeout: float = 30.0

    def _wait_ready(self, timeout: float | None = None) -> None:
        super()._wait_ready(timeout or self.ready_timeout)


def _dir(name: str) -> Path:
    return PEERS_DIR / name


def _litellm_bin() -> Path:
    return _dir("litellm") / "bin" / "litellm"


def _portkey_script() -> Path:
    return _dir("portkey") / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"


def _package_version(package_json: Path) -> str | None:
    try:
        return json.loads(package_json.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def _installed_litellm() -> str | None:
    """The version of litellm in its virtualenv, or None; its [proxy] extras count as installed
    only once pip said so (the stamp written after a complete install)."""
    stamp = _dir("litellm") / "installed"
    if not _litellm_bin().exists() or not stamp.exists():
        return None
    found = sorted(_dir("litellm").glob("lib/python*/site-packages/litellm-*.dist-info"))
    return found[0].name.removeprefix("litellm-").removesuffix(".dist-info") if found else None


def _installed_portkey() -> tuple[str | None, str | None]:
    """(the gateway's version, the @hono/node-server it imports: its own copy if it has one, else the top one)."""
    modules = _dir("portkey") / "node_modules"
    gateway = _package_version(modules / "@portkey-ai" / "gateway" / "package.json")
    nested = modules / "@portkey-ai" / "gateway" / "node_modules" / "@hono" / "node-server" / "package.json"
    server = _package_version(nested if nested.exists() else modules / "@hono" / "node-server" / "package.json")
    return gateway, server


def _reason(text: str) -> str:
    """The line of an installer's output that says why it failed: pip's last `ERROR:` line,
    npm's first `npm error` line past its code (FetchError, E404, …), else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and "WARNING: Location" not in line]
    pip = [line for line in lines if line.startswith("ERROR:")]
    npm = [
        line.removeprefix("npm error").strip()
        for line in lines
        if line.startswith("npm error")
        and not line.startswith(("npm error code", "npm error syscall", "npm error errno"))
    ]
    npm = [line for line in npm if line and not line.startswith(("at ", "A complete log"))]
    return (pip[-1:] or npm[:1] or lines[-1:] or ["no output"])[0][:300]


def _run(argv: list[str], what: str, cwd: Path | None = None) -> str | None:
    """Run an install step; None when it worked, else why not, in one line."""
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"{what} took more than {INSTALL_TIMEOUT} s"
    except OSError as e:
        return f"{what}: {e}"
    if done.returncode != 0:
        return f"{what} failed ({done.returncode}): {_reason(done.stderr + done.stdout)}"
    return None


def _prepare_litellm() -> str | None:
    if _installed_litellm() == LITELLM_VERSION:
        return None
    venv = _dir("litellm")
    spec = f"litellm[proxy]=={LITELLM_VERSION}"
    if not (venv / "bin" / "python").exists():
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        # From the project's interpreter: the same Python, none of the project's packages.
        why = _run([PYTHON, "-m", "venv", str(venv)], "creating LiteLLM's virtualenv")
        if why:
            return why
    (venv / "installed").unlink(missing_ok=True)
    # Short timeouts and one retry: an unreachable PyPI is said in a minute, not in fifteen.
    why = _run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--timeout", "30", "--retries", "1", spec],
        f"pip install {spec}",
    )
    if why:
        return why
    (venv / "installed").write_text(spec + "\n")
    found = _installed_litellm()
    return None if found == LITELLM_VERSION else f"pip installed litellm {found}, not {LITELLM_VERSION}"


def _prepare_portkey() -> str | None:
    if not shutil.which("node") or not shutil.which("npm"):
        return "node and npm are not on PATH"
    if _installed_portkey() == (PORTKEY_VERSION, HONO_NODE_SERVER_VERSION):
        return None
    where = _dir("portkey")
    where.mkdir(parents=True, exist_ok=True)
    package = {
        "name": "bench-peer-portkey",
        "private": True,
        "description": "Portkey's gateway for bench/peers.py",
        "dependencies": {"@portkey-ai/gateway": PORTKEY_VERSION, "@hono/node-server": HONO_NODE_SERVER_VERSION},
        # The gateway's own dependency on it too, else npm nests a newer copy under the gateway.
        "overrides": {"@hono/node-server": HONO_NODE_SERVER_VERSION},
    }
    (where / "package.json").write_text(json.dumps(package, indent=2) + "\n")
    # --ignore-scripts: its postinstall runs patch-package on patches the package does not ship.
    why = _run(
        [
            "npm",
            "install",
            "--no-audit",
            "--no-fund",
            "--ignore-scripts",
            "--fetch-timeout=30000",
            "--fetch-retries=1",
            "--loglevel=error",
        ],
        f"npm install @portkey-ai/gateway@{PORTKEY_VERSION}",
        cwd=where,
    )
    if why:
        return why
    found = _installed_portkey()
    if found != (PORTKEY_VERSION, HONO_NODE_SERVER_VERSION):
        return f"npm installed @portkey-ai/gateway {found[0]} with @hono/node-server {found[1]}"
    return None


def prepare(name: str) -> str | None:
    """Install the peer `name` if it is not there at its pinned version. None when it is ready
    to start, else why it cannot be, in one line (the suite skips it, saying so)."""
    if name == "litellm":
        return _prepare_litellm()
    if name == "portkey":
        return _prepare_portkey()
    return f"unknown peer {name!r} (known: {', '.join(PEERS)})"


def versions() -> dict[str, str]:
    """The installed peers' versions (and what runs them), for the results' meta."""
    found = {}
    litellm = _installed_litellm()
    if litellm:
        found["litellm"] = litellm
    gateway, server = _installed_portkey()
    if gateway:
        found["portkey"] = gateway
        found["portkey @hono/node-server"] = server or "?"
        try:
            found["node"] = subprocess.run(
                ["node", "--version"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return found


def litellm_config(upstream_url: str, models: list[str]) -> str:
    """LiteLLM's proxy config: each benchmark model routed to Anthropic's Messages API at the mock.
    Written as JSON, which is YAML."""
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {"model": f"anthropic/{model}", "api_base": upstream_url, "api_key": "bench"},
            }
            for model in dict.fromkeys(models)  # scenarios share models: one entry each
        ],
        # The images scenario's URLs are on loopback (bench/images.py), which LiteLLM refuses to
        # fetch unless allowed (as the gateway's config allows private hosts).
        "litellm_settings": {"set_verbose": False, "json_logs": False, "user_url_allowed_hosts": ["127.0.0.1"]},
        "general_settings": {"master_key": LITELLM_KEY},
    }
    return json.dumps(config, indent=2) + "\n"


def peer_system(name: str, upstream_url: str, workdir: Path, models: list[str]) -> System:
    """The peer `name` (prepared already) in front of the upstream at `upstream_url`, serving
    `models`, listening on 127.0.0.1 only; its clients speak Chat Completions."""
    port = free_port()
    if name == "litellm":
        config = workdir / "litellm.yaml"
        config.write_text(litellm_config(upstream_url, models))
        return PeerSystem(
            "litellm",
            port,
            "/v1/chat/completions",
            [f"Authorization: Bearer {LITELLM_KEY}"],
            [str(_litellm_bin()), f"--config={config}", "--host=127.0.0.1", f"--port={port}", "--num_workers=1"],
            ready_path="/health/liveliness",
            api="openai",
            env=os.environ | LITELLM_ENV,
            extra={"config": str(config), "version": LITELLM_VERSION},
            ready_timeout=READY_TIMEOUT["litellm"],
        )
    if name == "portkey":
        loopback = workdir / "portkey-loopback.mjs"
        loopback.write_text(LOOPBACK_MJS)
        return PeerSystem(
            "portkey",
            port,
            "/v1/chat/completions",
            [
                "x-portkey-provider: anthropic",
                f"x-portkey-custom-host: {upstream_url}/v1",
                "Authorization: Bearer bench",  # the upstream's key, which Portkey passes on
            ],
            # --headless: no log console UI (nor its /log/stream); NODE_ENV=production as deployed.
            ["node", "--import", loopback.as_uri(), str(_portkey_script()), f"--port={port}", "--headless"],
            ready_path="/",
            api="openai",
            cwd=_dir("portkey"),
            env=os.environ | {"NODE_ENV": "production"},
            extra={"version": PORTKEY_VERSION},
            ready_timeout=READY_TIMEOUT["portkey"],
        )
    raise ValueError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")


def listening_addresses(system: System) -> set[str]:
    """The "address:port" the system's processes listen on, to prove it is on 127.0.0.1 only."""
    return {f"{address}:{port}" for sockets in listening(system.pids()).values() for address, port in sockets}


def beyond_loopback(system: System) -> list[str]:
    """What the system listens on other than 127.0.0.1: nothing, for a peer fit to run."""
    return sorted(a for a in listening_addresses(system) if not a.startswith("127.0.0.1:"))


# ---------------------------------------------------------------------------------------------
# The command-line check.


def _post(system: System, body: bytes, headers: list[str] | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    hdrs = {"Content-Type": "application/json", **dict(h.split(": ", 1) for h in (headers or system.headers))}
    request = urllib.request.Request(f"http://127.0.0.1:{system.port}{system.path}", data=body, headers=hdrs)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# What OpenAI's Chat Completions API answers to each request the check sends, to read the answers against.
SPEC = {
    "nonstream": "object chat.completion, id chatcmpl-…, choices[0] {index, message {role, content, refusal},"
    " logprobs, finish_reason stop|length|tool_calls|content_filter}; usage.prompt_tokens counts all input,"
    " cached included (prompt_tokens_details.cached_tokens is part of it); total = prompt + completion",
    "stream50": "chunks chat.completion.chunk, one id throughout; each choice {index, delta, logprobs, finish_reason}"
    " (null until the last); no usage without stream_options.include_usage; the stream ends with data: [DONE]",
    "stream50 with stream_options.include_usage": "every chunk has usage: null, then one more chunk, choices [],"
    " with the usage, before data: [DONE]",
    "tool (stream)": "the first tool_calls delta has index, id, type function, function.name, then fragments of"
    " function.arguments; finish_reason tool_calls",
    "bad request: no messages": "400, {error: {message, type invalid_request_error, param messages, code}}",
    "bad request: unknown model": "404, {error: {message, type invalid_request_error, param model, code model_not_found}}",
    "bad request: not JSON": "400, {error: {message, type invalid_request_error, param, code}}",
}


def _show(title: str, answers: dict[str, tuple[int, bytes]]) -> None:
    """Each system's answer, line by line (SSE's blank lines left out, each line cut at 600)."""
    print(f"\n### {title}")
    if title in SPEC:
        print(f"spec: {SPEC[title]}")
    for name, (status, data) in answers.items():
        lines = [line for line in data.decode(errors="replace").splitlines() if line.strip()]
        print(f"\n--- {name}: {status}, {len(data)} bytes, {len(lines)} lines")
        for line in lines:
            print("    " + line[:600] + (" …" if len(line) > 600 else ""))


def main() -> int:
    import argparse
    import tempfile

    import orjson
    from drive import check
    from scenarios import SCENARIOS, SLOW, anthropic_request, openai_request
    from systems import floor_system, gateway_system, images_system, mock_system

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default=",".join(PEERS), help="which peers (default: all)")
    parser.add_argument("--no-answers", action="store_true", help="only install, start and check")
    args = parser.parse_args()

    models = [s.model for s in SCENARIOS.values()] + [SLOW.model]
    chat = [s for s in SCENARIOS.values() if "openai" in s.apis]
    failed = False
    with tempfile.TemporaryDirectory(prefix="ezat-peers-") as tmp:
        workdir = Path(tmp)
        mock = mock_system().start(workdir)
        upstream = f"http://127.0.0.1:{mock.port}"
        started: list[System] = []
        try:
            images_at = ""
            if any(s.images for s in chat):
                images = images_system().start(workdir)
                started.append(images)
                images_at = f"http://127.0.0.1:{images.port}"
            peers = []
            for name in args.peers.split(","):
                began = time.monotonic()
                why = prepare(name)
                print(f"{name}: {'ready' if why is None else 'skipped: ' + why} ({time.monotonic() - began:.1f} s)")
                if why is None:
                    peers.append(name)
            systems = [gateway_system(upstream, workdir, models)] if not args.no_answers else []
            systems += [peer_system(name, upstream, workdir, models) for name in peers]
            for system in systems:
                began = time.monotonic()
                system.start(workdir)
                started.append(system)
                addresses = sorted(listening_addresses(system))
                print(f"{system.name}: listening on {', '.join(addresses)} (ready in {time.monotonic() - began:.1f} s)")
                if beyond_loopback(system):
                    failed = True
                    print(f"{system.name} FAILED: listens beyond 127.0.0.1")
            for system in systems:
                for scenario in chat:
                    body = workdir / f"{system.name}-{scenario.name}.json"
                    body.write_bytes(openai_request(scenario, images_at))
                    try:
                        check(system, scenario, body)
                        print(f"{system.name:8} {scenario.name:10} ok")
                    except Exception as e:  # every failure is reported, then the exit status
                        failed = True
                        detail = e.read()[:500] if hasattr(e, "read") else b""  # an HTTPError's body
                        print(f"{system.name:8} {scenario.name:10} FAILED: {e} {detail.decode(errors='replace')}")
            if args.no_answers:
                return int(failed)
            everyone = {s.name: s for s in systems}
            # What the upstream said, for the truth of usage and stop reasons.
            floor = floor_system(upstream).start(workdir)
            started.append(floor)
            for scenario in (SCENARIOS["nonstream"], SCENARIOS["stream50"], SCENARIOS["tool"]):
                _show(
                    f"upstream (the mock, through the floor): {scenario.name}",
                    {"mock": _post(floor, anthropic_request(scenario))},
                )
            nonstream, stream = openai_request(SCENARIOS["nonstream"]), openai_request(SCENARIOS["stream50"])
            with_usage = orjson.dumps(orjson.loads(stream) | {"stream_options": {"include_usage": True}})
            tool = openai_request(SCENARIOS["tool"])
            missing = orjson.dumps({k: v for k, v in orjson.loads(nonstream).items() if k != "messages"})
            unknown = orjson.dumps(orjson.loads(nonstream) | {"model": "no-such-model"})
            for title, body in (
                ("nonstream", nonstream),
                ("stream50", stream),
                ("stream50 with stream_options.include_usage", with_usage),
                ("tool (stream)", tool),
                ("bad request: no messages", missing),
                ("bad request: unknown model", unknown),
                ("bad request: not JSON", b"{not json"),
            ):
                _show(title, {name: _post(system, body) for name, system in everyone.items()})
        finally:
            for system in reversed(started):
                system.stop()
            mock.stop()
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
