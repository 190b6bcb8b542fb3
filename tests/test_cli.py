"""The `ezat-gateway` command as a user runs it: real processes on loopback."""

from __future__ import annotations

import asyncio
import os
import re
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import anthropic
import openai
import pytest
from yarl import URL

from tests.support import MODEL, UPSTREAM_KEY, ServeProcess, free_port, run_command, spawn

ROOT = Path(__file__).parent.parent


async def stop(process: asyncio.subprocess.Process) -> str:
    """SIGTERM (unless it has ended), then its output."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    output, _ = await asyncio.wait_for(process.communicate(), 10)
    return output.decode()


GOOD_CONFIG = """
[server]
host = "127.0.0.1"
port = {port}

[[deployments]]
name = "mock"
base_url = "http://127.0.0.1:{upstream_port}"
api_key = "${{UPSTREAM_SECRET}}"

[[models]]
id = "anthropic/claude-sonnet-5-5"
upstream_model = "claude-sonnet-5-5"
deployments = ["mock"]
pricing = {{ input = 3.0, output = 15.0, cache_write = 3.75, cache_read = 0.30 }}

[[keys]]
key = "sk-from-config"
name = "laptop"
"""


async def test_check_config_accepts_a_good_file(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(GOOD_CONFIG.format(port=8080, upstream_port=8081))
    status, output = await run_command("check-config", str(path), env={"UPSTREAM_SECRET": "s"})
    assert status == 0
    assert output == f"{path}: ok (1 deployment, 1 model, 1 key)\n"


async def test_check_config_lists_every_problem_with_its_path(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(GOOD_CONFIG.format(port=99999, upstream_port=8081) + "\n[images]\nallow_private = true\n")
    status, output = await run_command("check-config", str(path))
    assert status == 1
    assert sorted(output.splitlines()) == [
        "deployments[0].api_key: environment variable UPSTREAM_SECRET is not set",
        "images.allow_private: unknown key",
        "server.port: expected an integer from 1 to 65535",
    ]


async def printed_key(served: ServeProcess) -> str:
    """The local key the embedded-defaults gateway prints on starting."""
    async with asyncio.timeout(10):
        while not (found := re.search(r"Your local key: (\S+)\n", served.output())):
            await asyncio.sleep(0.05)
    return found.group(1)


async def test_serve_raises_its_open_files_limit_to_the_hard_one(tmp_path):
    # A stream holds two sockets (its client's and its upstream's): left at a common default of
    # 1,024, the soft limit would cap the gateway near 500 streams.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"this machine's hard limit on open files is {hard}")
    served = ServeProcess(tmp_path)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what the gateway inherits
    try:
        await served.start("--port", str(served.port), wait=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        await served.wait_until_up()
        assert resource.prlimit(served.process.pid, resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        await served.stop()


def syn_retransmissions() -> int:
    """The kernel's count of SYNs it has sent again since it started (TcpExt: TCPSynRetrans)."""
    names, values = (
        line.split() for line in Path("/proc/net/netstat").read_text().splitlines() if line.startswith("TcpExt:")
    )
    return int(dict(zip(names, values))["TCPSynRetrans"])


async def test_serve_holds_a_burst_of_connections_it_has_not_accepted_yet(tmp_path):
    # A busy gateway accepts late; the kernel completes the connections meanwhile, as many as the
    # listen queue holds. With aiohttp's 128, a burst's later clients would wait 1, 3, 7 s… for
    # their SYN to be sent again.
    burst = 600
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    if somaxconn < burst:
        pytest.skip(f"this machine caps every listen queue at {somaxconn} (net.core.somaxconn)")
    served = ServeProcess(tmp_path)
    await served.start("--port", str(served.port))
    connections = []
    try:
        os.kill(served.process.pid, signal.SIGSTOP)  # busy: it accepts nothing
        try:

            async def connect():
                async with asyncio.timeout(10):
                    connections.append(await asyncio.open_connection("127.0.0.1", served.port))

            retried = syn_retransmissions()
            results = await asyncio.gather(*(connect() for _ in range(burst)), return_exceptions=True)
            # No client's SYN was sent again (the kernel's count, not a clock, which a busy
            # machine would make late): the listen queue held every one.
            retried = syn_retransmissions() - retried
        finally:
            os.kill(served.process.pid, signal.SIGCONT)
        assert [r for r in results if r is not None] == [] and len(connections) == burst
        assert retried == 0
    finally:
        for _, writer in connections:
            writer.close()
        await served.stop()


async def test_serve_on_embedded_defaults_answers_with_the_mock_upstream(tmp_path):
    served = ServeProcess(tmp_path)  # no config file
    try:
        await served.start("--port", str(served.port))
        key = await printed_key(served)

        async with served.client(api_key=key) as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello!"}]
            )
            assert completion.choices[0].message.content.endswith("You said: Hello!")
            stream = await client.chat.completions.create(
                model=MODEL, stream=True, messages=[{"role": "user", "content": "Again"}]
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text.endswith("You said: Again")
            with pytest.raises(openai.AuthenticationError):
                async with served.client(api_key="sk-other") as other:
                    await other.models.list()
    finally:
        await served.stop()
    assert served.process.returncode == 0
    assert "curl http://127.0.0.1" in served.log.read_text()
    # the demo's own SQLite file and the local key live in the working directory, the key across restarts
    assert (tmp_path / "ezat-demo.db").exists()
    assert not (tmp_path / "ezat-gateway.db").exists()  # a config file's default: not the demo's
    assert (tmp_path / "ezat-gateway.key").read_text().strip() == key
    assert (tmp_path / "ezat-gateway.key").stat().st_mode & 0o077 == 0

    # Started again in the same directory: the same key, printed and accepted.
    restarted = ServeProcess(tmp_path, "restarted")
    try:
        await restarted.start("--port", str(restarted.port))
        assert await printed_key(restarted) == key
        async with restarted.client(api_key=key) as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Still me?"}]
            )
            assert completion.choices[0].message.content.endswith("You said: Still me?")
    finally:
        await restarted.stop()
    assert restarted.process.returncode == 0
    assert (tmp_path / "ezat-gateway.key").read_text().strip() == key


@pytest.mark.parametrize(
    ("provider", "mock"), [("bedrock", "mock Amazon Bedrock"), ("vertex", "mock Google Vertex AI")]
)
async def test_serve_on_embedded_defaults_answers_with_a_clouds_mock(tmp_path, provider, mock):
    # `make demo PROVIDER=bedrock`: the demo's one model on the cloud's mock, signed in to as to the cloud.
    served = ServeProcess(tmp_path)  # no config file
    try:
        await served.start("--port", str(served.port), "--mock-provider", provider)
        key = await printed_key(served)
        async with served.client(api_key=key) as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello!"}]
            )
        async with anthropic.AsyncAnthropic(base_url=served.url, api_key=key, max_retries=0) as claude:
            async with claude.messages.stream(
                model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Again"}]
            ) as stream:
                message = await stream.get_final_message()
    finally:
        await served.stop()
    assert served.process.returncode == 0
    assert completion.choices[0].message.content.endswith("You said: Hello!")
    assert message.content[0].text.endswith("You said: Again") and message.model == MODEL
    output = served.output()
    assert f"--mock-provider {provider}: answering with the built-in {mock} at http://127.0.0.1:" in output
    answered = re.findall(r" 200 request_id=\S+ .*?deployment=(\S+) provider=(\S+) ", output)
    assert answered == [(provider, provider)] * 2  # the access lines: the cloud's deployment answered both


async def test_serve_mock_provider_is_for_the_embedded_defaults_only(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(GOOD_CONFIG.format(port=free_port(), upstream_port=8081))
    status, output = await run_command("serve", "--config", str(path), "--mock-provider", "bedrock")
    assert status == 2
    assert output.splitlines()[-1] == (
        "ezat-gateway: error: --mock-provider is for the embedded defaults: not with --config (or $EZAT_CONFIG)"
    )


async def test_serve_with_a_config_file_and_the_mock_upstream_command(tmp_path):
    upstream_port = free_port()
    gateway = ServeProcess(tmp_path, "gateway", GOOD_CONFIG, env={"UPSTREAM_SECRET": "s"}, upstream_port=upstream_port)
    port = gateway.port
    mock = await spawn("mock-upstream", "--port", str(upstream_port))
    try:
        await gateway.start()
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-from-config") as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "via config"}]
            )
        assert completion.choices[0].message.content.endswith("You said: via config")
    finally:
        await gateway.stop()
        await stop(mock)
    assert gateway.process.returncode == 0


async def test_the_demo_and_a_config_in_one_directory_keep_each_others_keys(tmp_path, upstream):
    """Each start makes its store's keys match its config; sharing a database, the demo would
    revoke the config file's keys and the other way round."""
    config = dict(env={"UPSTREAM_SECRET": UPSTREAM_KEY}, upstream_port=URL(upstream.url).port)
    gateway = ServeProcess(tmp_path, "gateway", GOOD_CONFIG, **config)  # no [storage]: the default file
    demo = ServeProcess(tmp_path, "demo")
    restarted = ServeProcess(tmp_path, "restarted", GOOD_CONFIG, **config)
    question = [{"role": "user", "content": "still mine?"}]
    try:
        await gateway.start()
        await demo.start("--port", str(demo.port))
        demo_key = await printed_key(demo)
        async with gateway.client(api_key="sk-from-config") as client:  # first asked after the demo started
            await client.chat.completions.create(model=MODEL, messages=question)
        await gateway.stop()
        await restarted.start()
        async with demo.client(api_key=demo_key) as client:  # first asked after the config's restart
            await client.chat.completions.create(model=MODEL, messages=question)
    finally:
        for served in (gateway, demo, restarted):
            await served.stop()

    # `keys` without a config file manages the demo's keys; with one, its [storage]'s.
    # (Each says first which database it opened.)
    status, listed = await run_command("keys", "list", cwd=tmp_path)
    assert status == 0, listed
    assert listed.splitlines()[0] == f"using the database at {tmp_path / 'ezat-demo.db'} (SQLite)"
    assert [line.split()[1] for line in listed.splitlines()[2:]] == ["local"]
    status, listed = await run_command("keys", "list", "--config", str(gateway.config), cwd=tmp_path)
    assert status == 0, listed
    assert listed.splitlines()[0] == f"using the database at {tmp_path / 'ezat-gateway.db'} (SQLite)"
    assert [line.split()[1] for line in listed.splitlines()[2:]] == ["laptop"]
    assert "True" not in listed.split()  # neither revoked
    assert (tmp_path / "ezat-demo.db").exists() and (tmp_path / "ezat-gateway.db").exists()


async def test_check_config_warns_of_a_key_that_has_expired(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        GOOD_CONFIG.format(port=8080, upstream_port=8081)
        + """
[[keys]]
key = "sk-alice-secret"
name = "alice"
expires_at = 2025-01-01T00:00:00Z

[[keys]]
key = "sk-nameless-secret"
expires_at = 2025-06-30T12:00:00+02:00

[[keys]]
key = "sk-retired-secret"
name = "retired"
expires_at = 2025-01-01T00:00:00Z
revoked = true                       # refused anyway: nothing to warn of

[[keys]]
key = "sk-future-secret"
name = "future"
expires_at = 2999-01-01T00:00:00Z
"""
    )
    status, output = await run_command("check-config", str(path), env={"UPSTREAM_SECRET": "s"})
    assert status == 0  # a warning: the file is valid
    assert output.splitlines() == [
        f"{path}: ok (1 deployment, 1 model, 5 keys)",
        "keys[1] (alice): expired at 2025-01-01T00:00:00+00:00; requests with it get 401",
        "keys[2]: expired at 2025-06-30T10:00:00+00:00; requests with it get 401",
    ]
    assert "secret" not in output


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("options, command", [((), "serve"), (("PORT=8090",), "serve --port 8090")])
def test_make_demo_takes_a_port(options, command):
    # Not make's own variables either: under `make test` they would make this a sub-make.
    environment = {
        name: value for name, value in os.environ.items() if name not in ("PORT", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    }
    # -n prints the commands without running them (nor the virtualenv's setup, if due).
    made = subprocess.run(
        ["make", "-n", "--no-print-directory", "demo", *options],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    assert made.stdout.splitlines()[-1] == f".venv/bin/ezat-gateway {command}"


async def test_serve_refuses_a_bad_config(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text("[server]\nport = 'eighty'\n")
    status, output = await run_command("serve", "--config", str(path), cwd=tmp_path)
    assert status == 1
    assert "server.port: expected an integer" in output


@pytest.mark.parametrize(
    "args, expected",
    [
        (("serve", "--port", "70000"), "argument --port: expected a whole number from 1 to 65535, not '70000'"),
        (("serve", "--workers", "-2"), "argument --workers: expected a whole number from 1 to 1024, not '-2'"),
        (("mock-upstream", "--port", "0"), "argument --port: expected a whole number from 1 to 65535, not '0'"),
    ],
)
async def test_out_of_range_options_are_usage_errors(tmp_path, args, expected):
    status, output = await run_command(*args, cwd=tmp_path)
    assert status == 2
    assert expected in output and "Traceback" not in output


async def test_a_bad_storage_url_is_refused_without_showing_it(tmp_path):
    status, output = await run_command("usage", "--storage", "postgresq://admin:hunter2@db/x", cwd=tmp_path)
    assert (status, output) == (2, "--storage: expected a sqlite:///, postgresql:// or postgres:// URL\n")


@pytest.mark.parametrize(
    "url", ["postgresql://admin:hunter2@127.0.0.1:1/x?sslmode=bogus", "postgresql://admin:hunter2@127.0.0.1:1/x"]
)
async def test_a_storage_url_postgresql_refuses_is_one_line_not_a_traceback(tmp_path, url):
    status, output = await run_command("keys", "list", "--storage", url, cwd=tmp_path)
    assert status == 1
    assert output.startswith("ezat-gateway keys: ") and output.count("\n") == 1, output
    assert "hunter2" not in output


async def test_serve_with_workers_reports_a_bad_config_once(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text("[server]\nport = 'eighty'\n")
    status, output = await run_command("serve", "--config", str(path), "--workers", "2", cwd=tmp_path)
    assert status == 1
    assert output.count("server.port: expected an integer") == 1 and "Traceback" not in output
