"""Read-only endpoints: health, the model list and each model (in OpenAI's shape, or in
Anthropic's for a request that carries `anthropic-version`), and the model catalog."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.config import Config, Model, Pricing
from middlewares.core.context import API_KEY
from middlewares.core.errors import invalid_request, model_not_found

_CREATED = 1_767_225_600  # 2026-01-01: model ids carry no date of their own
_CREATED_AT = "2026-01-01T00:00:00Z"  # the same, as Anthropic's API writes it
MAX_PAGE = 1000  # Anthropic's model list: the most models one page may ask for


def _owner(model: Model) -> str:
    return model.id.partition("/")[0] if "/" in model.id else "ezat"


_RATES = ("input", "output", "cache_write", "cache_read", "cache_write_1h")


def _rates(pricing: Pricing) -> dict[str, str]:  # USD per million tokens, as strings: exact decimals
    return {name: str(getattr(pricing, name)) for name in _RATES}


def _catalog_entry(model: Model) -> dict[str, Any]:
    entry = {
        "id": model.id,
        "object": "model",
        "owned_by": _owner(model),
        "aliases": list(model.aliases),
        "capabilities": {
            "sampling": model.sampling,
            "efforts": list(model.efforts),
            "forced_tool_choice": model.forced_tool_choice,
        },
        "limits": {"max_output_tokens": model.max_output_tokens, "min_cache_tokens": model.min_cache_tokens},
        "pricing": _rates(model.pricing),  # what a deployment without prices of its own bills
    }
    if model.pricing_by_deployment:
        # Some deployments have prices of their own: each rate's dearest among them all, beside
        # the default. (Not by deployment: its names are the operator's, never shown to clients.)
        entry["pricing_up_to"] = {
            name: str(max(getattr(pricing, name) for pricing in model.every_pricing)) for name in _RATES
        }
    return entry


def _openai_entry(model: Model) -> dict[str, Any]:
    return {"id": model.id, "object": "model", "created": _CREATED, "owned_by": _owner(model)}


def _anthropic_entry(model: Model) -> dict[str, Any]:
    return {
        "type": "model",
        "id": model.id,
        "display_name": model.id,
        "created_at": _CREATED_AT,
        "max_tokens": model.max_output_tokens,
    }


def speaks_anthropic(request: web.Request) -> bool:
    """Whether a request speaks Anthropic's API: by its route, or, on a route both APIs share
    (the models), by the `anthropic-version` header Anthropic's clients always send."""
    path = request.path
    if path.startswith(("/anthropic/", "/v1/messages")):
        return True
    if path.startswith(("/openai/", "/v1/chat/", "/v1/responses")):
        return False
    return "anthropic-version" in request.headers


def catalog_handlers(config: Config):
    """(healthz, model list, one model, catalog) handlers. The model list and a model are the
    caller's key's (behind auth): the models it may use."""
    catalog = {"object": "list", "data": [_catalog_entry(m) for m in config.models]}

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def list_models(request: web.Request) -> web.Response:
        key = request[API_KEY]
        models = [m for m in config.models if key.allows(m.id)]
        if speaks_anthropic(request):
            return web.json_response(_anthropic_page(models, request.query))
        return web.json_response({"object": "list", "data": [_openai_entry(m) for m in models]})

    async def one_model(request: web.Request) -> web.Response:
        name = request.match_info["model"]
        model = config.model(name)
        if model is None or not request[API_KEY].allows(model.id):
            raise model_not_found(name)
        return web.json_response(_anthropic_entry(model) if speaks_anthropic(request) else _openai_entry(model))

    async def model_catalog(request: web.Request) -> web.Response:
        return web.json_response(catalog)

    return healthz, list_models, one_model, model_catalog


def _anthropic_page(models: list[Model], query) -> dict[str, Any]:
    """One page of Anthropic's model list: `limit` models (20 unless it says), after `after_id`
    or before `before_id` when it names one."""
    raw = query.get("limit", "20")
    limit = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 4 else 0
    if not 1 <= limit <= MAX_PAGE:
        raise invalid_request(f"limit: Input should be a whole number from 1 to {MAX_PAGE}", "limit")
    ids = [m.id for m in models]
    start, end = 0, len(models)
    for field in ("after_id", "before_id"):
        if field in query:
            if query[field] not in ids:
                raise invalid_request(f"{field}: no model `{query[field]}` in this list", field)
            if field == "after_id":
                start = ids.index(query[field]) + 1
            else:
                end = ids.index(query[field])
    if "before_id" in query and "after_id" not in query:
        start = max(start, end - limit)  # the page that ends just before it
    page = models[start:end][:limit]
    return {
        "data": [_anthropic_entry(m) for m in page],
        # Paging back from before_id, more lie before the page; else, after it.
        "has_more": start > 0 if "before_id" in query and "after_id" not in query else start + len(page) < end,
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
    }
