"""What the suite needs from the machine: wrk and py-spy (installed when missing), enough open
files, and a description of the machine and versions for the results."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from systems import PYTHON, ROOT


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_wrk() -> str | None:
    """Debian's wrk, installed here when missing and we are root; None: use the asyncio client."""
    found = shutil.which("wrk")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        if not found:
            log("wrk is not installed (and cannot be here): the asyncio client drives every scenario")
        return found
    log("installing wrk: apt-get install -y wrk")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "wrk"]
    try:
        if subprocess.run(install, env=env, capture_output=True, timeout=300).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
            subprocess.run(install, env=env, capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        pass
    found = shutil.which("wrk")
    if not found:
        log("could not install wrk: the asyncio client drives every scenario")
    return found


def ensure_py_spy() -> str:
    spy = Path(PYTHON).parent / "py-spy"
    if not spy.exists():
        log("installing py-spy into the virtualenv")
        subprocess.run([PYTHON, "-m", "pip", "install", "--quiet", "py-spy"], check=True, timeout=300)
    return str(spy)


def machine(wrk: str | None) -> dict:
    def first(path: str, prefix: str) -> str:
        try:
            return next((line.split(":", 1)[1].strip() for line in open(path) if line.startswith(prefix)), "?")
        except OSError:
            return "?"

    def out(*argv: str) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    import aiohttp
    import orjson

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": first("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "memory": first("/proc/meminfo", "MemTotal"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "orjson": orjson.__version__,
        "uvloop": _installed("uvloop"),
        "wrk": " ".join(out(wrk, "--version").split()[:2]) if wrk else None,
        "commit": out("git", "rev-parse", "--short", "HEAD"),
        "dirty": bool(out("git", "status", "--porcelain", "--untracked-files=no")),
    }


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
