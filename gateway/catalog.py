"""Read-only endpoints: health, OpenAI's model list, and the model catalog."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.config import Config, Model
from middlewares.core.context import API_KEY

_CREATED = 1_767_225_600  # 2026-01-01: model ids carry no date of their own


def _catalog_entry(model: Model) -> dict[str, Any]:
    pricing = model.pricing
    return {
        "id": model.id,
        "object": "model",
        "owned_by": model.id.partition("/")[0] if "/" in model.id else "ezat",
        "capabilities": {
            "sampling": model.sampling,
            "efforts": list(model.efforts),
            "forced_tool_choice": model.forced_tool_choice,
        },
        "limits": {"max_output_tokens": model.max_output_tokens, "min_cache_tokens": model.min_cache_tokens},
        "pricing": {  # USD per million tokens, as strings: exact decimals
            "input": str(pricing.input),
            "output": str(pricing.output),
            "cache_write": str(pricing.cache_write),
            "cache_read": str(pricing.cache_read),
        },
    }


def catalog_handlers(config: Config):
    """(healthz, OpenAI model list, catalog) handlers. The model list is the caller's key's
    (behind auth): the models it may use."""
    openai_models = [
        {"id": m.id, "object": "model", "created": _CREATED, "owned_by": _catalog_entry(m)["owned_by"]}
        for m in config.models
    ]
    catalog = {"object": "list", "data": [_catalog_entry(m) for m in config.models]}

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def list_models(request: web.Request) -> web.Response:
        key = request[API_KEY]
        return web.json_response({"object": "list", "data": [m for m in openai_models if key.allows(m["id"])]})

    async def model_catalog(request: web.Request) -> web.Response:
        return web.json_response(catalog)

    return healthz, list_models, model_catalog
