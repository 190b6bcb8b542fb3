"""The `ezat-gateway` command as a user runs it: real processes on loopback."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.support import MODEL, free_port

COMMAND = str(Path(sys.executable).with_name("ezat-gateway"))


async def wait_until_up(url: str, process: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            assert process.returncode is None, "the process exited"
            try:
                async with http.get(url) as response:
                    if response.status < 500:
                        return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never came up")


async def start(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> asyncio.subprocess.Process:
    environment = {k: v for k, v in os.environ.items() if k not in ("ANTHROPIC_API_KEY", "EZAT_API_KEY", "EZAT_CONFIG")}
    return await asyncio.create_subprocess_exec(
        COMMAND, *args, env={**environment, **(env or {})}, cwd=cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )


async def finish(process: asyncio.subprocess.Process) -> str:
    output, _ = await asyncio.wait_for(process.communicate(), 10)
    return output.decode()


async def stop(process: asyncio.subprocess.Process) -> str:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    return await finish(process)


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
    process = await start("check-config", str(path), env={"UPSTREAM_SECRET": "s"})
    output = await finish(process)
    assert process.returncode == 0
    assert "ok (1 deployments, 1 models, 1 keys)" in output


async def test_check_config_lists_every_problem_with_its_path(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(GOOD_CONFIG.format(port=99999, upstream_port=8081) + "\n[images]\nallow_private = true\n")
    process = await start("check-config", str(path))
    output = await finish(process)
    assert process.returncode == 1
    assert sorted(output.splitlines()) == [
        "deployments[0].api_key: environment variable UPSTREAM_SECRET is not set",
        "images.allow_private: unknown key",
        "server.port: expected an integer from 1 to 65535",
    ]


async def test_serve_on_embedded_defaults_answers_with_the_mock_upstream(tmp_path):
    port = free_port()
    process = await start("serve", "--port", str(port), cwd=tmp_path)
    try:
        await wait_until_up(f"http://127.0.0.1:{port}/healthz", process)
        banner = b""
        while b"Your local key:" not in banner:
            banner += await asyncio.wait_for(process.stdout.readline(), 10)
        key = re.search(rb"Your local key: (\S+)", banner).group(1).decode()

        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/openai/v1", api_key=key) as client:
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
                async with openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{port}/openai/v1", api_key="sk-other", max_retries=0
                ) as other:
                    await other.models.list()
    finally:
        output = await stop(process)
    assert process.returncode == 0
    assert "curl http://127.0.0.1" in output + banner.decode()
    # the embedded SQLite file and the local key live in the working directory, the key across restarts
    assert (tmp_path / "ezat-gateway.db").exists()
    assert (tmp_path / "ezat-gateway.key").read_text().strip() == key
    assert (tmp_path / "ezat-gateway.key").stat().st_mode & 0o077 == 0


async def test_serve_with_a_config_file_and_the_mock_upstream_command(tmp_path):
    port, upstream_port = free_port(), free_port()
    path = tmp_path / "gateway.toml"
    path.write_text(GOOD_CONFIG.format(port=port, upstream_port=upstream_port))
    mock = await start("mock-upstream", "--port", str(upstream_port))
    gateway = await start("serve", "--config", str(path), env={"UPSTREAM_SECRET": "s"}, cwd=tmp_path)
    try:
        await wait_until_up(f"http://127.0.0.1:{port}/healthz", gateway)
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-from-config") as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "via config"}]
            )
        assert completion.choices[0].message.content.endswith("You said: via config")
    finally:
        await stop(gateway)
        await stop(mock)
    assert gateway.returncode == 0


async def test_serve_refuses_a_bad_config(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text("[server]\nport = 'eighty'\n")
    process = await start("serve", "--config", str(path), cwd=tmp_path)
    output = await finish(process)
    assert process.returncode == 1
    assert "server.port: expected an integer" in output
