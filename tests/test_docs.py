"""The documentation is true and stands alone: the examples of docs/mounting.md run as written,
served on loopback, and no document or module points outside the repository."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from pathlib import Path

import aiohttp
import pytest
from aioresponses import aioresponses

from gateway.config import Config
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


def documented_defaults(section: str) -> dict[str, str]:
    """The `default` column of docs/configuration.md's table for `[section]` (or `[[section]]`)."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    start = re.search(rf"^## `\[\[?{section}\]\]?`$", text, re.M)
    assert start is not None, section
    end = text.find("\n## ", start.end())
    return dict(re.findall(r"^\| `(\w+)` \| [^|]* \| ([^|]*) \|", text[start.end() : end], re.M))


@pytest.mark.parametrize("section", [field.name for field in dataclasses.fields(Config)])
def test_each_documented_default_is_the_configs_own(section):
    # The defaults live in the code (the stages' own, which the config takes); the page says
    # them again for the reader, and this keeps it saying the same.
    kind = typing.get_type_hints(Config)[section]
    cls = typing.get_args(kind)[0] if typing.get_args(kind) else kind  # tuple[Model, ...]: Model
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    compared = 0
    for key, cell in documented_defaults(section).items():
        literal = cell.strip()
        if key not in defaults or not re.fullmatch(r"`[^`]+`", literal):
            continue  # "required", "none", a default worked out from other keys
        try:
            documented = tomllib.loads(f"v = {literal[1:-1]}")["v"]
        except tomllib.TOMLDecodeError:
            continue
        default = defaults[key]
        assert documented == (list(default) if isinstance(default, tuple) else default), (section, key)
        compared += 1
    assert compared or not defaults, f"no default of [{section}] is documented"
