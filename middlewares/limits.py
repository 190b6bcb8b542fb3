"""The limits stage: admission, before any costly work (downloading images, translating,
calling the upstream). It resolves the model once, for every later stage, and decides whether
the caller's key may run this request at all: the model must exist (404), the key may use it
and every fallback model the request names (403), has not spent its limit (402) and is within
its rate (429). A refused request costs the gateway nothing more."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from middlewares.core.chain import stage
from middlewares.core.context import API_KEY, BODY, FALLBACK_MODELS, MODEL, SETTLE
from middlewares.core.errors import GatewayError, invalid_request, model_not_found, retry_after
from middlewares.core.protocols import FindModel, ModelSpec, RateLimiter, Spent
from middlewares.core.records import KeyRecord
from middlewares.core.usage import Usage

__all__ = ["limits_middleware"]


def limits_middleware(*, find_model: FindModel, spent: Spent | None = None, limiter: RateLimiter | None = None):
    """Resolves `request[BODY]["model"]` with `find_model(id)` into `request[MODEL]`, and the
    request's `models` (fallbacks, tried in order when the asked model cannot answer) into
    `request[FALLBACK_MODELS]`. Then, for the key in `request[API_KEY]`: its `models` must allow
    each (403 `permission_error`); `spent(key id)` must be below its `spend_limit_usd` (402
    `insufficient_quota`); `limiter.admit(key)` must let it through (429 `rate_limit_exceeded`
    with `retry-after`). Without `spent` or `limiter`, those checks are not made.
    `request[SETTLE](usage)` (billing calls it) charges the tokens a request used to its rate."""
    if not callable(find_model):
        raise TypeError("limits_middleware: find_model must be a callable")

    @stage("limits", requires=(BODY, API_KEY), provides=(MODEL, FALLBACK_MODELS, SETTLE))
    async def limits(request: web.Request, handler) -> web.StreamResponse:
        body, key = request[BODY], request[API_KEY]
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise invalid_request("model: required", "model")
        model = find_model(name)
        if model is None:
            raise model_not_found(name)
        fallbacks = _fallbacks(body.get("models"), model, find_model)
        for allowed in (model, *fallbacks):
            if not key.allows(allowed.id):
                raise GatewayError(403, f"This key may not use the model `{allowed.id}`.", type="permission_error")
        if spent is not None and key.spend_limit_usd is not None and await spent(key.id) >= key.spend_limit_usd:
            raise GatewayError(
                402,
                f"This key has reached its spend limit of ${key.spend_limit_usd}.",
                type="insufficient_quota",
                code="insufficient_quota",
            )
        if limiter is not None:
            wait = await limiter.admit(key)
            if wait:
                raise GatewayError(
                    429,
                    "Too many requests for this key; wait and try again.",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers=retry_after(wait),
                )
        request[MODEL], request[FALLBACK_MODELS] = model, fallbacks
        request[SETTLE] = _settle(limiter, key)
        return await handler(request)

    return limits


def _fallbacks(models: Any, asked: ModelSpec, find_model: FindModel) -> tuple[ModelSpec, ...]:
    """The request's `models`, resolved: alternatives to the asked model, in order, once each."""
    if models is None:
        return ()
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise invalid_request("models: expected a list of model ids", "models")
    resolved: dict[str, ModelSpec] = {}
    for name in models:
        model = find_model(name)
        if model is None:
            raise model_not_found(name)
        if model.id != asked.id:
            resolved.setdefault(model.id, model)
    return tuple(resolved.values())


def _settle(limiter: RateLimiter | None, key: KeyRecord):
    async def settle(usage: Usage) -> None:
        if limiter is not None:
            await limiter.charge_tokens(key, usage.prompt_tokens + usage.output_tokens)

    return settle
