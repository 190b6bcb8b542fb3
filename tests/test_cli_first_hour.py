"""What a newcomer meets in the first hour with the `ezat-gateway` command: its version, which
database it opened, the example config's placeholders, a revoked key, a port already taken.
Each runs the installed command (or `python -m gateway`) as a subprocess."""

from __future__ import annotations

import asyncio
import shutil
import socket
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import aiohttp
import pytest

from tests.support import COMMAND, SERVE_CONFIG, ServeProcess, clean_environment, free_port, read_store, run_command

ROOT = Path(__file__).parent.parent


async def ezat(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Runs `ezat-gateway ARGS` to its end: (exit status, stdout, stderr), kept apart."""
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        *args,
        env=clean_environment(**(env or {})),
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 20)
    return process.returncode, out.decode(), err.decode()


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


# --- Which database the store commands open


@pytest.mark.parametrize(
    "command",
    [
        ("keys", "list"),
        ("orgs", "list"),
        ("usage",),
        ("keys", "revoke", "alice"),
        ("orgs", "suspend", "acme"),
        ("keys", "create", "--name", "alice"),  # a key no gateway would read
        ("orgs", "create", "acme"),
        ("admin-tokens", "create", "--name", "ops", "--role", "admin"),
    ],
)
async def test_no_command_makes_a_database_in_a_folder_without_one(tmp_path, command):
    status, out, err = await ezat(*command, cwd=tmp_path)
    assert (status, out) == (1, "")
    assert err == (
        f"ezat-gateway {' '.join(command[:2])}: no database at "
        f"{tmp_path / 'ezat-demo.db'}, and this command makes none; "
        "run it from the folder where the gateway runs, or pass --config FILE or --storage URL\n"
    )
    assert list(tmp_path.iterdir()) == []  # nothing made


async def test_a_relative_path_of_the_configs_is_the_working_directorys(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text('[storage]\nurl = "sqlite:///gateway.db"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    status, out, err = await ezat("usage", "--config", str(config), cwd=elsewhere)
    assert (status, out) == (1, "")
    assert err == (
        f"ezat-gateway usage: no database at {elsewhere / 'gateway.db'}, and this command makes none; "
        "a relative sqlite:/// path is the working directory's: run it from the folder where the gateway runs, "
        "or make the path absolute\n"
    )
    status, out, err = await ezat("keys", "create", "--name", "alice", "--config", str(config), cwd=elsewhere)
    assert (status, out) == (1, "")
    assert err.startswith(f"ezat-gateway keys create: no database at {elsewhere / 'gateway.db'}, and this command")
    status, out, err = await ezat("keys", "list", "--storage", f"sqlite:///{tmp_path / 'nowhere.db'}", cwd=elsewhere)
    assert (status, out) == (1, "")
    assert err.endswith(", and this command makes none; the gateway makes it when it first starts\n")
    assert list(elsewhere.iterdir()) == []


async def test_keys_create_makes_a_database_at_an_absolute_path_and_says_so_then_each_command_names_it(tmp_path):
    db = tmp_path / "gateway.db"
    config = tmp_path / "gateway.toml"
    config.write_text(f'[storage]\nurl = "sqlite:///{db}"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    status, out, err = await ezat("keys", "create", "--name", "alice", "--config", str(config), cwd=elsewhere)
    assert status == 0, err
    assert out.startswith("created key 1 (alice); it is shown only this once:\n")
    assert err.splitlines() == [
        f"using the database at {db} (SQLite)",
        f"gateway.db did not exist: created an empty one in {tmp_path}",
    ]
    assert db.exists() and list(elsewhere.iterdir()) == []

    status, out, err = await ezat("keys", "list", "--config", str(config), cwd=elsewhere)
    assert status == 0, err
    assert err == f"using the database at {db} (SQLite)\n"  # and no word of making it
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["alice"]

    # Named on the command line, it is not repeated back; made, it is still said.
    made = tmp_path / "made.db"
    status, out, err = await ezat("orgs", "create", "acme", "--storage", f"sqlite:///{made}", cwd=tmp_path)
    assert (status, err) == (0, f"made.db did not exist: created an empty one in {tmp_path}\n")
    status, out, err = await ezat("orgs", "list", "--storage", f"sqlite:///{made}", cwd=tmp_path)
    assert (status, err) == (0, "")
    assert "acme" in out


async def test_a_postgresql_database_is_named_without_its_password(tmp_path):
    config = tmp_path / "gateway.toml"
    # Port 1: nothing answers, but the command names the database before it connects.
    config.write_text(
        '[storage]\nurl = "postgresql://admin:hunter2@127.0.0.1:1/ledger?sslmode=disable&password=hunter2"\n'
    )
    status, out, err = await ezat("usage", "--config", str(config), cwd=tmp_path)
    assert (status, out) == (1, "")
    using, failed = err.splitlines()
    assert using == "using the database at postgresql://admin@127.0.0.1:1/ledger?sslmode=disable (PostgreSQL)"
    assert failed.startswith("ezat-gateway usage: ") and "hunter2" not in err


# --- check-config: placeholders and counts

ONE_DEPLOYMENT = """
[[deployments]]
name = "a"
base_url = "https://api.anthropic.com"
api_key = "sk-ant-example"
"""


async def test_check_config_warns_of_a_placeholder_digest_not_of_a_real_one(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        ONE_DEPLOYMENT
        + f"""
[[keys]]
name = "laptop"
key_sha256 = "{"0" * 64}"

[[keys]]
key_sha256 = "{"F" * 64}"                # read as lowercase, a placeholder all the same

[[keys]]
name = "retired"
key_sha256 = "{"a" * 64}"
revoked = true                             # refused anyway: nothing to warn of

[[keys]]
name = "real"
key_sha256 = "{"0" * 63}1"                 # not one character repeated

[[keys]]
key = "sk-a-plaintext-key"
"""
    )
    status, output = await run_command("check-config", str(path), cwd=tmp_path)
    advice = 'put your key\'s there (printf %s "$THE_KEY" | sha256sum), or use key = "${ENV_VAR}"'
    assert (status, output.splitlines()) == (
        0,  # a warning: the file is valid
        [
            f"{path}: ok (1 deployment, 0 models, 5 keys)",
            'keys[0] (laptop): key_sha256 is a placeholder ("0" 64 times), no key\'s digest, so no request can use '
            f"this entry; {advice}",
            f'keys[1]: key_sha256 is a placeholder ("f" 64 times), no key\'s digest, so no request can use this entry; '
            f"{advice}",
        ],
    )


async def test_check_config_counts_in_the_singular_for_one(tmp_path):
    path = tmp_path / "gateway.toml"
    model = '\n[[models]]\nid = "m{n}"\nupstream_model = "u{n}"\ndeployments = ["a"]\nfree = true\n'
    path.write_text(ONE_DEPLOYMENT + model.format(n=1) + '\n[[keys]]\nkey = "sk-one"\n')
    assert await run_command("check-config", str(path), cwd=tmp_path) == (
        0,
        f"{path}: ok (1 deployment, 1 model, 1 key)\n",
    )
    path.write_text(
        ONE_DEPLOYMENT
        + ONE_DEPLOYMENT.replace('"a"', '"b"')
        + model.format(n=1)
        + model.format(n=2)
        + '\n[[keys]]\nkey = "sk-one"\n\n[[keys]]\nkey = "sk-two"\n'
    )
    assert await run_command("check-config", str(path), cwd=tmp_path) == (
        0,
        f"{path}: ok (2 deployments, 2 models, 2 keys)\n",
    )


# --- keys update on a revoked key


async def test_keys_update_on_a_revoked_key_changes_it_and_says_it_stays_revoked(tmp_path):
    storage = ("--storage", f"sqlite:///{tmp_path / 'gateway.db'}")
    assert (await ezat("keys", "create", "--name", "alice", *storage, cwd=tmp_path))[0] == 0
    status, _, err = await ezat("keys", "revoke", "alice", *storage, cwd=tmp_path)
    assert (status, err) == (0, "")
    status, out, err = await ezat("keys", "update", "alice", "--tpm", "500", *storage, cwd=tmp_path)
    assert (status, err) == (
        0,
        "key 'alice' is revoked: the change is kept, but its requests still get 401 (--unrevoke makes it usable again)\n",
    )
    assert out == (await ezat("keys", "list", *storage, cwd=tmp_path))[1]  # the key as it is now
    _, (key,) = await read_store(storage[1])
    assert (key.tpm, key.revoked) == (500, True)


# --- A port already taken

PORT_CONFIG = (
    ONE_DEPLOYMENT + '\n[server]\nhost = "127.0.0.1"\nport = 8080\n\n[storage]\nurl = "sqlite:///gateway.db"\n'
)


@pytest.mark.parametrize(
    "command",
    [
        ("serve",),  # the embedded defaults: the demo
        ("serve", "--config", "gateway.toml"),
        ("serve", "--config", "gateway.toml", "--workers", "2"),
        ("mock-upstream",),
    ],
    ids=" ".join,
)
async def test_a_port_already_taken_fails_first_in_one_line(tmp_path, command):
    (tmp_path / "gateway.toml").write_text(PORT_CONFIG)
    with socket.socket() as taken:  # a plain socket, as any other program's
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, output = await run_command(*command, "--port", str(port), cwd=tmp_path)
    assert (status, output) == (
        1,
        f"ezat-gateway {command[0]}: port {port} on 127.0.0.1 is already in use (another process listens there): "
        "stop it, or choose another port with --port\n",
    )
    # Nothing was started before: no database, no demo key, no mock upstream announced.
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gateway.toml"]


async def test_workers_do_not_share_a_port_with_another_gateways_workers(tmp_path):
    # SO_REUSEPORT would let a second gateway's workers join the first's port and take half its
    # connections: the second is refused as on any port already taken.
    first = ServeProcess(tmp_path, "first", PORT_CONFIG.replace("port = 8080", "port = {port}"))
    await first.start("--workers", "2")
    try:
        status, output = await run_command(
            "serve", "--config", str(first.config), "--workers", "2", "--port", str(first.port), cwd=tmp_path
        )
        assert (status, output) == (
            1,
            f"ezat-gateway serve: port {first.port} on 127.0.0.1 is already in use (another process listens there): "
            "stop it, or choose another port with --port\n",
        )
    finally:
        await first.stop()


async def test_a_server_that_says_it_listens_answers_at_once(tmp_path):
    served = ServeProcess(tmp_path)  # the demo
    await served.start("--port", str(served.port), wait=False)
    try:
        async with asyncio.timeout(15):
            while "ezat-gateway listening on" not in served.output():
                assert served.process.returncode is None, served.output()
                await asyncio.sleep(0.02)
        async with aiohttp.ClientSession() as http:  # the first try, not a retry
            async with http.get(served.url + "/healthz") as response:
                assert response.status == 200
    finally:
        await served.stop()
    assert served.process.returncode == 0
    assert "console" not in served.output()  # the demo has no [admin]


async def test_a_server_with_admin_on_names_the_console_and_how_to_get_a_token(tmp_path, upstream):
    served = ServeProcess(
        tmp_path,
        config=SERVE_CONFIG + "\n[admin]\n",
        storage_url=f"sqlite:///{tmp_path / 'g.db'}",
        upstream_url=upstream.url,
    )
    await served.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(served.url + "/console/sign-in") as response:
                assert response.status == 200
    finally:
        await served.stop()
    assert (
        f"admin console at {served.url}/console (admin API under /admin/v1/): sign in with an admin token, "
        "one of the config's [[admin.tokens]] or one made with "
        "`ezat-gateway admin-tokens create --config FILE --name NAME --role admin`"
    ) in served.output()


async def test_a_demo_that_cannot_keep_its_key_fails_before_it_says_it_answers(tmp_path):
    (tmp_path / "ezat-gateway.key").mkdir()  # where the demo keeps its key: not a file it can read
    status, output = await run_command("serve", "--port", str(free_port()), cwd=tmp_path)
    assert (status, output) == (1, "ezat-gateway serve: Is a directory: ezat-gateway.key\n")


# --- Errors in words, not Python's


async def test_a_database_that_refuses_is_named_in_the_one_line(tmp_path):
    (tmp_path / "notes.db").write_text("not a database\n")
    status, output = await run_command("keys", "list", "--storage", "sqlite:///notes.db", cwd=tmp_path)
    assert (status, output) == (1, f"ezat-gateway keys: {tmp_path / 'notes.db'} (SQLite): file is not a database\n")
    status, output = await run_command("keys", "list", "--storage", "postgresql://admin:hunter2@127.0.0.1:1/x")
    assert status == 1 and output.startswith("ezat-gateway keys: postgresql://admin@127.0.0.1:1/x (PostgreSQL): ")
    assert "Errno" not in output and "hunter2" not in output and output.count("\n") == 1
