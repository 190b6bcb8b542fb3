"""The package as someone outside the checkout gets it: `pip wheel .` builds a wheel whose
`ezat-gateway` command works in a fresh virtualenv, and building it leaves the checkout as it was;
and the lock files, which `make` and the image install, pin what pyproject.toml declares.

Offline and quick: the wheel is built by the build backend the lock installed in this virtualenv
(`--no-build-isolation`; elsewhere pip fetches the backend into a build environment of its own),
and the fresh virtualenv finds its dependencies among this virtualenv's installed packages."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PIP = (sys.executable, "-m", "pip")
BUDGET_SECONDS = 60
"""The whole test's time: it runs in every `make test`, so a build gone slow fails it."""


def pyproject() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)


def declared_version() -> str:
    return pyproject()["project"]["version"]


def pip_environment() -> dict[str, str]:
    """This process's environment without pip's settings (a constraints file, another index) or a
    PYTHONPATH that could put the checkout back on the fresh virtualenv's path."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    return {**kept, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def git_status() -> set[str]:
    """What git reports, ignored paths included (a build's build/ or .egg-info would show), less the
    __pycache__ folders that any Python process importing the code may write meanwhile, and
    hypothesis's .hypothesis/, which the fuzz tests may make meanwhile in another of make test's
    workers."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored"], cwd=ROOT, check=True, capture_output=True, text=True, timeout=30
    )
    return {line for line in status.stdout.splitlines() if not line.endswith(("__pycache__/", " .hypothesis/"))}


def test_a_wheel_built_from_the_checkout_installs_a_working_command_and_leaves_nothing_behind(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to compare the build against")
    if importlib.util.find_spec("hatchling") is None:
        pytest.skip("the build backend is not in this virtualenv (make installs it from requirements.lock)")
    deadline = time.monotonic() + BUDGET_SECONDS

    def run(*args: str | Path, cwd: Path = tmp_path) -> str:
        done = subprocess.run(
            [str(arg) for arg in args],
            cwd=cwd,
            env=pip_environment(),
            capture_output=True,
            text=True,
            timeout=max(deadline - time.monotonic(), 1),
        )
        assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}{done.stderr}"
        return done.stdout

    before = git_status()
    dist = tmp_path / "dist"
    run(*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir", dist, ".", cwd=ROOT)
    (wheel,) = dist.glob("ezat_gateway-*.whl")

    # A fresh virtualenv; its dependencies are this virtualenv's packages (a .pth names a folder of
    # links to them), less ezat-gateway's own metadata and editable hook, so only the wheel provides it.
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    installed = Path(metadata.distribution("aiohttp").locate_file(""))
    dependencies = tmp_path / "dependencies"
    dependencies.mkdir()
    for entry in installed.iterdir():
        if "ezat_gateway" not in entry.name and not entry.name.startswith("__editable__"):
            (dependencies / entry.name).symlink_to(entry)
    site_packages = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    (site_packages / "dependencies.pth").write_text(f"{dependencies}\n")

    # Without --no-deps: pip checks the wheel's requirements against what is installed, offline.
    run(*PIP, "--python", python, "install", "--no-index", wheel)

    assert run(venv / "bin" / "ezat-gateway", "--version") == f"ezat-gateway {declared_version()}\n"
    where = run(python, "-c", "import gateway, middlewares; print(gateway.__file__, middlewares.__file__)")
    assert all(Path(path).is_relative_to(site_packages) for path in where.split()), where
    assert git_status() == before


# --- The lock files


def pins(lock: str) -> dict[str, Version]:
    """A lock file's `name==version` lines, by the name's canonical form."""
    lines = (ROOT / lock).read_text().splitlines()
    return {canonicalize_name(m[1]): Version(m[2]) for line in lines if (m := re.match(r"([\w.-]+)==([^\s;]+)", line))}


def declared(*extras: str) -> list[Requirement]:
    """pyproject.toml's dependencies and those of `extras`, less the package's own name (an extra
    that names another of its extras)."""
    project = pyproject()["project"]
    wanted = [*project["dependencies"], *(r for extra in extras for r in project["optional-dependencies"][extra])]
    return [r for r in map(Requirement, wanted) if canonicalize_name(r.name) != canonicalize_name(project["name"])]


def unpinned(requirements: list[Requirement], pinned: dict[str, Version]) -> list[str]:
    """The requirements a lock has no version of, or one outside their range."""
    wrong = []
    for requirement in requirements:
        version = pinned.get(canonicalize_name(requirement.name))
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            wrong.append(f"{requirement} (locked: {version or 'nothing'})")
    return wrong


def test_the_lock_pins_every_dependency_extra_and_the_build_backend_within_their_ranges():
    # A range changed in pyproject.toml without `make lock` fails here, not on someone's fresh machine.
    build_backend = [Requirement(r) for r in pyproject()["build-system"]["requires"]]
    extras = pyproject()["project"]["optional-dependencies"]
    assert unpinned([*declared(*extras), *build_backend], pins("requirements.lock")) == []


def test_the_images_lock_pins_the_runtime_at_the_locks_versions():
    runtime = pins("requirements-runtime.lock")
    assert unpinned(declared("fast", "otel"), runtime) == []
    everything = pins("requirements.lock")
    assert {name: version for name, version in runtime.items() if everything.get(name) != version} == {}
