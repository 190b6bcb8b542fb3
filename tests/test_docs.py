"""The documentation is true and stands alone: the examples of docs/mounting.md run as written,
served on loopback, and no document or module points outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest
from aioresponses import aioresponses

from tests.support import Gateway
from tests.test_images import PNG, FakedResponse

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "mounting.md").read_text(), re.S)


@pytest.fixture
async def example():
    """Runs the n-th example of docs/mounting.md as a module would (not as __main__) and serves
    its `app` on loopback."""
    started: list[Gateway] = []

    async def start(index: int) -> Gateway:
        namespace = {"__name__": "example"}
        exec(compile(EXAMPLES[index], f"docs/mounting.md example {index + 1}", "exec"), namespace)
        started.append(await Gateway(namespace["app"]).start())
        return started[-1]

    yield start
    for gateway in started:
        await gateway.runner.cleanup()


def test_mounting_has_its_three_examples():
    assert len(EXAMPLES) == 3


async def test_the_size_limit_and_refusals_example(example):
    app = await example(0)
    async with aiohttp.ClientSession() as http:
        async with http.post(app.url + "/v1/chat/completions", json={"messages": [], "n": 2}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["message"] == "n: only 1 choice per request is supported"
        async with http.post(
            app.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}
        ) as response:
            assert (response.status, await response.json()) == (200, {"messages": 1})
        async with http.post(app.url + "/v1/chat/completions", data=b"x" * (4 * 1024 * 1024 + 1)) as response:
            assert response.status == 413


async def test_the_image_fetcher_example(example):
    app = await example(1)
    url = "https://images.example/cat.png"
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}],
            }
        ]
    }
    with aioresponses(passthrough=[app.url]) as mocked:
        mocked.get(url, response_class=FakedResponse, body=PNG)
        async with aiohttp.ClientSession() as http:
            async with http.post(app.url + "/describe", json=body) as response:
                assert (response.status, await response.json()) == (200, {"inlined": ["data:image/png;base64,"]})


async def test_the_auth_example(example):
    app = await example(2)
    async with aiohttp.ClientSession() as http:
        async with http.get(app.url + "/whoami", headers={"Authorization": "Bearer sk-alice"}) as response:
            assert (response.status, await response.json()) == (200, {"name": "alice", "models": ["anthropic/*"]})
        async with http.get(app.url + "/whoami", headers={"x-api-key": "sk-bob"}) as response:
            assert response.status == 401
            assert (await response.json())["error"]["code"] == "invalid_api_key"


OUTSIDE = re.compile(r"\.\./shared|shared/(spec|reference|DESIGN)|DESIGN\.md|000_1adce5796a0c04e3|004_468afdd32e302f84")


def test_no_document_or_module_points_outside_the_repository():
    files = [
        ROOT / "README.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("gateway/**/*.py"),
        *ROOT.glob("middlewares/**/*.py"),
        *ROOT.glob("bench/*.py"),
        *ROOT.glob("bench/*.md"),
        *ROOT.glob("deploy/**/*.*"),
        *ROOT.glob(".ci/*"),
        ROOT / "Makefile",
        *ROOT.glob("*.toml"),
        *(
            path
            for path in ROOT.glob("tests/**/*.*")
            if path.suffix in (".py", ".md", ".mjs", ".json")
            and "node_modules" not in path.parts
            and path != Path(__file__).resolve()
        ),
    ]
    pointing = [
        f"{path.relative_to(ROOT)}: {match[0]}" for path in files for match in OUTSIDE.finditer(path.read_text())
    ]
    assert pointing == []
