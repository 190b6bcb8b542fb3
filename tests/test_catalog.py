"""Health, the OpenAI model list and the model catalog."""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import openai
import pytest

from tests.support import MODEL, make_config


async def test_healthz_needs_no_key(gateway):
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/healthz") as response:
            assert response.status == 200
            assert await response.json() == {"status": "ok"}


async def test_models_list_through_the_sdk(client):
    page = await client.models.list()
    models = [m async for m in page]
    assert [m.id for m in models] == [MODEL, "test/small"]
    assert all(m.object == "model" and isinstance(m.created, int) for m in models)
    assert models[0].owned_by == "anthropic"


async def test_models_list_holds_only_the_models_the_key_may_use(start_gateway, upstream):
    """Spec: clients pick "a model id from GET /openai/v1/models"; one the key may not use would be a 403."""
    config = make_config(upstream.url)
    config = replace(config, keys=(replace(config.keys[0], models=("test/*",)),))
    gateway = await start_gateway(config)
    async with gateway.client() as client:
        assert [m.id async for m in await client.models.list()] == ["test/small"]


async def test_models_list_needs_a_key(gateway):
    async with gateway.client(api_key="sk-wrong") as wrong:
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()


async def test_catalog(gateway):
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/api/models") as response:
            assert response.status == 200
            catalog = await response.json()
    entry = catalog["data"][0]
    assert entry == {
        "id": MODEL,
        "object": "model",
        "owned_by": "anthropic",
        "aliases": [],
        "capabilities": {
            "sampling": False,
            "efforts": ["low", "medium", "high", "xhigh", "max"],
            "forced_tool_choice": True,
        },
        "limits": {"max_output_tokens": 64000, "min_cache_tokens": 1024},
        # The 1-hour cache's write, not configured here: twice the input price, as the upstream charges.
        "pricing": {"input": "3", "output": "15", "cache_write": "3.75", "cache_read": "0.30", "cache_write_1h": "6"},
    }
    assert catalog["data"][1]["limits"]["max_output_tokens"] == 4096
