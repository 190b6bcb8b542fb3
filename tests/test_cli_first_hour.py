"""What a newcomer meets in the first hour with the `ezat-gateway` command: its version, which
database it opened, the example config's placeholders, a revoked key, a port already taken.
Each runs the installed command (or `python -m gateway`) as a subprocess."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from tests.support import clean_environment, run_command

ROOT = Path(__file__).parent.parent


def declared_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)["project"]["version"]


async def test_version_is_the_installed_packages():
    status, output = await run_command("--version")
    assert (status, output) == (0, f"ezat-gateway {metadata.version('ezat-gateway')}\n")
    assert metadata.version("ezat-gateway") == declared_version()


async def test_version_from_a_source_tree_that_is_not_installed(tmp_path):
    # A fresh checkout (no egg-info from an editable install), with the dependencies installed
    # but not the package: this virtualenv's site-packages, less ezat-gateway's own metadata and
    # import hook.
    checkout = tmp_path / "checkout"
    for package in ("gateway", "middlewares"):
        shutil.copytree(ROOT / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", checkout)
    site = tmp_path / "site-packages"
    site.mkdir()
    installed = Path(metadata.distribution("aiohttp").locate_file(""))
    for entry in installed.iterdir():
        if "ezat_gateway" not in entry.name:
            (site / entry.name).symlink_to(entry)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-S",  # no site: neither the virtualenv's .pth files nor its metadata
        "-m",
        "gateway",
        "--version",
        env=clean_environment(PYTHONPATH=f"{checkout}:{site}"),
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 20)
    assert (process.returncode, output.decode()) == (0, f"ezat-gateway {declared_version()}\n")
