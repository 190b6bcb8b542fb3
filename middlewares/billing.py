"""The billing stage. On the way in: may this key use this model (403), has it spent its
limit (402), is it over its rate (429)? On the way out: price the usage and record it in the
ledger, durably, before the reply ends: before the body of a message, before `[DONE]` of a
stream. Failed requests are not billed; a stream the client closes early is, for what was
produced, with the output estimated from the text seen."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from aiohttp import web

from gateway.config import Model
from gateway.context import ANSWERED_MODEL, API_KEY, BODY, DEPLOYMENT, FALLBACK_MODELS, request_id
from gateway.errors import GatewayError, model_not_found, retry_after
from gateway.ledger import Ledger
from gateway.ratelimit import RateLimiter
from gateway.reply import EventStreamReply, MessageReply
from gateway.storage import KeyRecord, LedgerRow
from gateway.usage import StreamUsage, Usage


def billing_middleware(
    *,
    find_model: Callable[[str], Model | None],
    spent: Callable[[int], Awaitable[Decimal]],
    limiter: RateLimiter,
    ledger: Ledger,
):
    async def billing(request: web.Request, handler) -> web.StreamResponse:
        key = request[API_KEY]
        model_id = request[BODY].get("model")
        model = find_model(model_id) if isinstance(model_id, str) else None
        if model is None:
            raise model_not_found(model_id)
        for allowed in (model.id, *request.get(FALLBACK_MODELS, ())):
            if not key.allows(allowed):
                raise GatewayError(403, f"This key may not use the model `{allowed}`.", type="permission_error")
        if key.spend_limit_usd is not None and await spent(key.id) >= key.spend_limit_usd:
            raise GatewayError(
                402,
                f"This key has reached its spend limit of ${key.spend_limit_usd}.",
                type="insufficient_quota",
                code="insufficient_quota",
            )
        wait = await limiter.admit(key)
        if wait:
            raise GatewayError(
                429,
                "Too many requests for this key; wait and try again.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers=retry_after(wait),
            )

        started = datetime.now(timezone.utc)
        reply = await handler(request)
        answered = find_model(request.get(ANSWERED_MODEL, model.id)) or model
        bill = Bill(request_id(request), key, model, answered, request.get(DEPLOYMENT, ""), started, ledger, limiter)
        if isinstance(reply, MessageReply):
            await bill.record(reply.usage)
        elif isinstance(reply, EventStreamReply):
            reply.events = BilledEvents(reply.events, reply.usage, bill)
        return reply

    return billing


class Bill:
    """What one request's ledger row needs, and recording it."""

    def __init__(self, rid: str, key: KeyRecord, asked: Model, answered: Model, deployment: str, started: datetime,
                 ledger: Ledger, limiter: RateLimiter) -> None:
        self.rid, self.key, self.asked, self.answered = rid, key, asked, answered
        self.deployment, self.started = deployment, started
        self._ledger, self._limiter = ledger, limiter

    async def record(self, usage: Usage, outcome: str = "complete") -> None:
        row = LedgerRow(
            request_id=self.rid,
            key_id=self.key.id,
            model=self.asked.id,
            answered_model=self.answered.id,
            deployment=self.deployment,
            input_tokens=usage.input_tokens,
            cache_write_tokens=usage.cache_write_tokens,
            cache_read_tokens=usage.cache_read_tokens,
            output_tokens=usage.output_tokens,
            reasoning_tokens=usage.reasoning_tokens,
            cost_usd=usage.cost(self.answered.pricing),  # priced as the model that answered
            outcome=outcome,
            started_at=self.started,
            finished_at=datetime.now(timezone.utc),
        )
        await self._ledger.record(row)
        await self._limiter.charge_tokens(self.key, usage.prompt_tokens + usage.output_tokens)


class BilledEvents:
    """The upstream's events, passed through unchanged; the row is recorded, from the stream's
    usage, before the batch that ends the stream goes on, so `[DONE]` follows the commit; the
    events that arrived with the end wait for it too, and a burst leaves in one write."""

    def __init__(self, events, usage: StreamUsage, bill: Bill) -> None:
        self._events = events
        self._usage = usage
        self._bill = bill
        self._settled = False  # billed, or failed and so never billed

    def __aiter__(self) -> BilledEvents:
        return self

    async def __anext__(self) -> list[dict[str, Any]]:
        batch = await self._events.__anext__()
        # Only the last event of a batch can end the stream: nothing after an end is read.
        ending = batch[-1]["type"] if batch else None
        if ending == "message_stop":
            self._settled = True
            await self._bill.record(self._usage.total())
        elif ending == "error":
            self._settled = True  # failed requests are not billed
        return batch

    async def aclose(self, failed: bool = False) -> None:
        # The upstream goes first: a client gone cancels it at once, not after the commit. What
        # is billed does not change meanwhile: usage is counted as events are read.
        try:
            await self._events.aclose(failed)
        finally:
            if not self._settled and not failed:
                # The client left before the end: bill what was produced, estimated from what was seen.
                self._settled = True
                await self._bill.record(self._usage.so_far(), "client_closed")
