"""The limits stage: admission, before any costly work (downloading images, translating,
calling the upstream). It resolves the model once, for every later stage, and decides whether
the caller's key may run this request at all: the model must exist (404), the key may use it
and every fallback model the request names (403), has not spent its limit (402) and is within
its rate (429). A refused request costs the gateway nothing more."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from middlewares.core.chain import stage
from middlewares.core.context import API_KEY, BODY, BODY_BYTES, FALLBACK_MODELS, MODEL, SETTLE
from middlewares.core.errors import GatewayError, invalid_request, model_not_found, retry_after
from middlewares.core.protocols import FindModel, ModelSpec, RateLimiter, Spent
from middlewares.core.records import KeyRecord
from middlewares.core.sizes import DEFAULT_MAX_TOKENS
from middlewares.core.usage import Usage, estimate_tokens

__all__ = ["limits_middleware"]


def limits_middleware(*, find_model: FindModel, spent: Spent | None = None, limiter: RateLimiter | None = None):
    """Resolves `request[BODY]["model"]` with `find_model(id)` into `request[MODEL]`, and the
    request's `models` (fallbacks, tried in order when the asked model cannot answer) into
    `request[FALLBACK_MODELS]`. Then, for the key in `request[API_KEY]`: its `models` must allow
    each (403 `permission_error`); `spent(key id)` must be below its `spend_limit_usd` (402
    `insufficient_quota`); `limiter.admit(key)` must let it through (429 `rate_limit_exceeded`
    with `retry-after`): the limiter takes one request and reserves the request's token estimate,
    its input estimated from its size and its output limit. Without `spent` or `limiter`, those
    checks are not made.

    `request[SETTLE](usage)`, which billing calls once the row is recorded, settles the
    reservation to the tokens used; `SETTLE(None)` gives it back, for a request that failed. A
    request that fails before its reply leaves this stage is settled so here."""
    if not callable(find_model):
        raise TypeError("limits_middleware: find_model must be a callable")

    @stage("limits", requires=(BODY, BODY_BYTES, API_KEY), provides=(MODEL, FALLBACK_MODELS, SETTLE))
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
        reserved = 0
        if limiter is not None:
            reserved = _token_estimate(body, request[BODY_BYTES], model) if key.tpm else 0
            wait = await limiter.admit(key, reserved)
            if wait:
                raise GatewayError(
                    429,
                    "Too many requests for this key; wait and try again.",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers=retry_after(wait),
                )
        request[MODEL], request[FALLBACK_MODELS] = model, fallbacks
        settle = request[SETTLE] = Reservation(limiter, key, reserved).settle
        try:
            return await handler(request)
        except BaseException:
            await settle(None)
            raise

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


def _token_estimate(body: dict[str, Any], body_bytes: int, model: ModelSpec) -> int:
    """The most tokens a request can take: its input, estimated from the body's size (JSON
    syntax makes that an overestimate), and its output limit."""
    for field in ("max_completion_tokens", "max_tokens"):
        limit = body.get(field)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return estimate_tokens(body_bytes) + min(limit, model.max_output_tokens)
    return estimate_tokens(body_bytes) + min(DEFAULT_MAX_TOKENS, model.max_output_tokens)


class Reservation:
    """The tokens a request reserved, settled once: to what it used, or back, if it failed."""

    __slots__ = ("_limiter", "_key", "_reserved", "_settled")

    def __init__(self, limiter: RateLimiter | None, key: KeyRecord, reserved: int) -> None:
        self._limiter, self._key, self._reserved = limiter, key, reserved
        self._settled = False

    async def settle(self, usage: Usage | None) -> None:
        if self._settled:
            return
        self._settled = True
        used = 0 if usage is None else usage.prompt_tokens + usage.output_tokens
        if self._limiter is not None and self._key.tpm and used != self._reserved:
            await self._limiter.charge_tokens(self._key, used - self._reserved)
