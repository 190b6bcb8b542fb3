"""The `ezat-gateway` command as a user runs it: real processes on loopback."""

from __future__ import annotations

import asyncio
import re
import signal
import socket

import openai
import pytest

from tests.support import MODEL, ServeProcess, free_port, run_command, spawn


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
    assert "ok (1 deployments, 1 models, 1 keys)" in output


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
    # the embedded SQLite file and the local key live in the working directory, the key across restarts
    assert (tmp_path / "ezat-gateway.db").exists()
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


async def test_a_port_already_taken_is_one_line_not_a_traceback(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, output = await run_command("serve", "--port", str(port), cwd=tmp_path)
    assert status == 1
    assert "ezat-gateway serve: [Errno 98] error while attempting to bind on address" in output
    assert "Traceback" not in output


async def test_serve_with_workers_reports_a_bad_config_once(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text("[server]\nport = 'eighty'\n")
    status, output = await run_command("serve", "--config", str(path), "--workers", "2", cwd=tmp_path)
    assert status == 1
    assert output.count("server.port: expected an integer") == 1 and "Traceback" not in output
