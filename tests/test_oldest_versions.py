"""The ranges in pyproject.toml are honest: the stage tests pass on the oldest versions they allow.

A fresh virtualenv in a temporary folder gets the lowest version each range names
(`uv pip compile --resolution lowest-direct`), the project itself, and what the stage tests
import; then the stage tests run in it. It downloads from PyPI, so it runs only when asked:
`make test-oldest` (CI runs it as a step of its own)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What the stage tests and their fixtures (tests/conftest.py, tests/support.py) import besides the
# runtime dependencies, by their names in the `test` extra.
TEST_PACKAGES = {"pytest", "pytest-aiohttp", "pytest-asyncio", "aioresponses", "openai", "hypothesis"}

# The stages' tests: each stage mounted alone, and the behaviour of each one through the gateway.
STAGE_TESTS = [
    "tests/test_stages.py",
    "tests/test_bounds.py",
    "tests/test_refusals.py",
    "tests/test_limits.py",
    "tests/test_ratelimit.py",
    "tests/test_images.py",
    "tests/test_caching.py",
    "tests/test_billing.py",
    "tests/test_errors.py",
]

pytestmark = pytest.mark.skipif(
    os.environ.get("EZAT_TEST_OLDEST") != "1",
    reason="downloads from PyPI: `make test-oldest` runs it",
)


def oldest_requirements() -> list[str]:
    """The runtime dependencies, and the test packages the stage tests need, with their ranges."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    test_extra = project["optional-dependencies"]["test"]
    wanted = [r for r in test_extra if re.match(r"[A-Za-z0-9_.-]+", r)[0].lower() in TEST_PACKAGES]
    assert len(wanted) == len(TEST_PACKAGES), f"the test extra no longer names all of {sorted(TEST_PACKAGES)}"
    return project["dependencies"] + wanted


def run(*command: str | Path, cwd: Path = ROOT, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(map(str, command))}\n{done.stdout[-20000:]}\n{done.stderr[-5000:]}"


def test_stage_tests_pass_on_the_oldest_versions_the_ranges_allow(tmp_path):
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv is needed: `make test-oldest` installs it"
    uv_env = {**os.environ, "UV_CACHE_DIR": str(tmp_path / "uv-cache")}  # the downloads stay in tmp_path
    requirements_in = tmp_path / "requirements.in"
    requirements_in.write_text("\n".join(oldest_requirements()) + "\n")
    pinned = tmp_path / "requirements.txt"
    lowest = ["--resolution", "lowest-direct", "--python", sys.executable]
    run(uv, "pip", "compile", "--quiet", *lowest, requirements_in, "-o", pinned, env=uv_env)
    venv = tmp_path / "venv"
    run(uv, "venv", "--quiet", "--python", sys.executable, venv, env=uv_env)
    python = venv / "bin" / "python"
    run(uv, "pip", "install", "--quiet", "--python", python, "-r", pinned, env=uv_env)
    # The project from the checkout, built in uv's own folder (with no dependency: they are pinned).
    run(uv, "pip", "install", "--quiet", "--python", python, "--no-deps", ROOT, env=uv_env)

    # The services the caller has (CI requires them) are passed on; nothing is written into the checkout.
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "VIRTUAL_ENV": str(venv)}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("EZAT_TEST_OLDEST")
    run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *STAGE_TESTS, env=env)
