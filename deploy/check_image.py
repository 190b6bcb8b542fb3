"""Builds the gateway's container image and proves it by running it, with podman (no Docker daemon
needed): the image runs as a non-root user on a read-only root filesystem with a mounted config,
answers /healthz and /readyz and its HEALTHCHECK, serves a chat completion and a stream from the
mock upstream (the same image's), logs JSON though started with a command of its own (not CMD),
finishes a stream it is serving when it gets SIGTERM and exits 0; and it reports the image's size
and the gateway's memory, idle and with 100 open streams (its footprint as a sidecar: SQLite, one
key).

    python deploy/check_image.py [--base IMAGE]

Without --base, the base is made once from Debian's own packages with mmdebstrap (no image
registry needed) and kept as localhost/ezat-python-base for the next run. podman, runc and
mmdebstrap are installed with apt when missing (as root). pip inside the build gets this
machine's CA bundle as the `pip_cert` build secret (for networks whose proxy re-signs TLS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from gateway.mock.upstream import FAST_MODELS

ROOT = Path(__file__).resolve().parent.parent
BASE = "localhost/ezat-python-base"
IMAGE = "localhost/ezat-gateway:check"
VOLUME = "ezat-check-data"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
KEY = "sk-image-check"
STREAMS = 100
# This machine's podman as root: runc, cgroupfs, and no default ulimits (raising them needs a
# capability the sandbox lacks: every run would fail with "error setting rlimit").
CONTAINERS_CONF = """[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
"""
GATEWAY_TOML = """
[server]
host = "127.0.0.1"
port = {port}
shutdown_timeout_seconds = 20
drain_seconds = 1

[storage]
url = "sqlite:////var/lib/ezat/gateway.db"

[[deployments]]
name = "mock"
base_url = "http://127.0.0.1:{upstream_port}"
api_key = "mock"
{models}
[[keys]]
name = "app"
key = "${{EZAT_API_KEY}}"
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="a base image with Python 3.11+ (default: made with mmdebstrap)")
    args = parser.parse_args()
    ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="ezat-image-check-"))
    os.environ["CONTAINERS_CONF"] = str(work / "containers.conf")
    (work / "containers.conf").write_text(CONTAINERS_CONF)
    remove_containers()  # any a stopped run left behind
    try:
        base = args.base or debian_base(work)
        started = time.monotonic()
        build(base)
        built_in = time.monotonic() - started
        report = asyncio.run(run_checks(work))
        report["build_seconds"] = round(built_in, 1)
        report["image_bytes"] = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
        report["base"] = base
        print(json.dumps(report, indent=2))
        print(
            f"image check passed: {report['image_bytes'] / 1e6:.0f} MB; gateway RSS idle "
            f"{report['rss_idle_mib']:.0f} MiB, with {STREAMS} open streams {report['rss_streams_mib']:.0f} MiB"
        )
        return 0
    finally:
        remove_containers()
        shutil.rmtree(work, ignore_errors=True)


def remove_containers() -> None:
    for name in ("ezat-check-gateway", "ezat-check-mock"):
        podman("rm", "-f", name, check=False)
    podman("volume", "rm", "-f", VOLUME, check=False)


def ensure_tools() -> None:
    missing = [tool for tool in ("podman", "runc", "mmdebstrap") if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"deploy/check_image.py needs {', '.join(missing)} (apt-get install {' '.join(missing)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, check=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "podman", "runc", "mmdebstrap"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def podman(*args: str, check: bool = True, **options) -> subprocess.CompletedProcess:
    """podman as this machine runs it; with `check`, a failure raises, saying what podman said."""
    done = subprocess.run(["podman", "--runtime", "runc", *args], capture_output=True, text=True, **options)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done


def container_log(name: str) -> str:
    """What the container wrote (its standard error is the log's)."""
    done = podman("logs", name, check=False)
    return done.stdout + done.stderr


def debian_base(work: Path) -> str:
    """Debian bookworm's Python, as an image made once and kept for later runs."""
    if podman("image", "exists", BASE, check=False).returncode != 0:
        rootfs = work / "rootfs.tar"
        subprocess.run(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=apt",
                "--include=python3,python3-venv,python3-pip,ca-certificates",
                "bookworm",
                str(rootfs),
            ],
            check=True,
        )
        podman("import", str(rootfs), BASE)
    return BASE


def build(base: str) -> None:
    secret = ["--secret", f"id=pip_cert,src={CA_BUNDLE}"] if CA_BUNDLE.exists() else []
    # --format docker: the OCI format has no HEALTHCHECK.
    podman(
        "build",
        "--format",
        "docker",
        "--network",
        "host",
        "-f",
        "deploy/Dockerfile",
        "--build-arg",
        f"BASE={base}",
        *secret,
        "-t",
        IMAGE,
        ".",
        cwd=ROOT,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_checks(work: Path) -> dict:
    upstream_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    # The fast mock's models (bench-slow streams for 10 s).
    models = "".join(f'\n[[models]]\nid = "{m}"\ndeployments = ["mock"]\nfree = true\n' for m in FAST_MODELS)
    config = work / "gateway.toml"
    config.write_text(GATEWAY_TOML.format(port=port, upstream_port=upstream_port, models=models))
    config.chmod(0o644)  # the container's user reads it
    podman(
        "run",
        "-d",
        "--name",
        "ezat-check-mock",
        "--network",
        "host",
        "--read-only",
        "--entrypoint",
        "python3",
        IMAGE,
        "-c",
        f"from gateway.mock.upstream import run; run('127.0.0.1', {upstream_port}, fast=True)",
    )
    podman(
        "run",
        "-d",
        "--name",
        "ezat-check-gateway",
        "--network",
        "host",
        "--read-only",
        # A volume for the SQLite ledger, which takes the image's /var/lib/ezat (and its owner).
        "--tmpfs",
        "/tmp",
        "-v",
        f"{VOLUME}:/var/lib/ezat",
        "-v",
        f"{config}:/etc/ezat/gateway.toml:ro",
        "-e",
        f"EZAT_API_KEY={KEY}",
        "-e",
        f"EZAT_PORT={port}",
        # A command of its own, not CMD: the image's environment alone makes its log JSON.
        IMAGE,
        "serve",
        "--config",
        "/etc/ezat/gateway.toml",
    )
    report: dict = {}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
        await until_up(http, url)
        async with http.get(url + "/readyz") as response:
            assert response.status == 200, f"/readyz: {response.status} {await response.text()}"
        podman("healthcheck", "run", "ezat-check-gateway")  # the image's HEALTHCHECK, run now
        uid = podman("exec", "ezat-check-gateway", "id", "-u").stdout.strip()
        assert uid == "10001", f"the gateway runs as uid {uid}"
        report["uid"] = int(uid)
        assert podman("exec", "ezat-check-gateway", "touch", "/opt/x", check=False).returncode != 0, (
            "the root filesystem is writable"
        )

        answer = await post(http, url, "bench-nonstream", stream=False)
        assert json.loads(answer)["choices"][0]["message"]["content"].startswith("Tokens arrive"), answer[:300]
        streamed = await post(http, url, "bench-stream50", stream=True)
        assert streamed.endswith(b"data: [DONE]\n\n") and b'"error"' not in streamed, streamed[-300:]

        pid = podman("inspect", "--format", "{{.State.Pid}}", "ezat-check-gateway").stdout.strip()
        report["rss_idle_mib"] = rss_mib(pid)
        streams = [asyncio.create_task(post(http, url, "bench-slow", stream=True)) for _ in range(STREAMS)]
        await asyncio.sleep(3)  # all open, mid-stream (each takes 10 s)
        report["rss_streams_mib"] = rss_mib(pid)
        bodies = await asyncio.gather(*streams)
        assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies), "a slow stream did not finish"

        # SIGTERM during a stream: /readyz turns 503 at once, the stream finishes, the exit is clean.
        last = asyncio.create_task(post(http, url, "bench-slow", stream=True))
        await asyncio.sleep(1.5)
        podman("kill", "--signal", "TERM", "ezat-check-gateway")
        await asyncio.sleep(0.3)
        async with http.get(url + "/readyz") as response:
            assert response.status == 503, f"/readyz after SIGTERM: {response.status}"
        body = await last
        assert body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body, body[-300:]
    exit_code = podman("wait", "ezat-check-gateway").stdout.strip()
    logs = container_log("ezat-check-gateway")
    assert exit_code == "0", f"exit code {exit_code}:\n{logs[-3000:]}"
    lines = [json.loads(line) for line in logs.splitlines() if line.strip()]  # every line: JSON, or this fails
    assert lines and any(line.get("logger") == "ezat.access" for line in lines), "no JSON access lines"
    assert KEY not in logs, "the key is in the log"
    report["exit_code_after_sigterm"] = 0
    return report


async def until_up(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(300):
        try:
            async with http.get(url + "/healthz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("the gateway never answered /healthz:\n" + container_log("ezat-check-gateway")[-3000:])


async def post(http: aiohttp.ClientSession, url: str, model: str, *, stream: bool) -> bytes:
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "Hello"}]}
    async with http.post(url + "/v1/chat/completions", json=body) as response:
        data = await response.read()
        assert response.status == 200, f"{model}: {response.status} {data[:300]!r}"
        return data


def rss_mib(pid: str) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return round(kib / 1024, 1)


if __name__ == "__main__":
    sys.exit(main())
