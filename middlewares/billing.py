"""The billing stage: metering, on the way out. It prices the usage and records it in the
ledger, durably, before the reply ends: before the body of a message, before `[DONE]` of a
stream. Failed requests are not billed; a stream the client closes early is, for what was
produced, with the output estimated from the text seen. Every number billed is the upstream's,
but an output count that is missing or cannot be true (middlewares/core/usage.py): the
estimate stands in for it, and a warning names the deployment. What the usage reports that the
pricing it is billed at does not price (a new field, a tier without rates) is logged once per model
(and per deployment with prices of its own), so that a new price is noticed. (Whether a request may run at all is
the limits stage's, on the way in.)"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Stage, stage
from middlewares.core.context import ANSWERED_MODEL, API_KEY, DEPLOYMENT, LEDGER_ROW, MODEL, SESSION, SETTLE, request_id
from middlewares.core.protocols import RecordRow
from middlewares.core.records import LedgerRow, Outcome
from middlewares.core.reply import Batch, EventStream, EventStreamReply, MessageReply, ends_stream
from middlewares.core.usage import StreamUsage, Usage, pricing_at

__all__ = ["billing_middleware"]

# The most unpriced things logged: what the upstream reports is not the gateway's to bound, and
# a value that changes on every answer would otherwise grow the set, and the log, without end.
WARNED_AT_MOST = 1_000

log = logging.getLogger("ezat.billing")


def billing_middleware(*, record: RecordRow) -> Stage:
    """Records one `LedgerRow` for the key in `request[API_KEY]` with `record(row)`, which
    returns once the row is committed: priced at the model that answered
    (`request[ANSWERED_MODEL]`, else `request[MODEL]`), at the deployment that answered
    (`request[DEPLOYMENT]`) where the model is priced per deployment (`PricedPerDeployment`). Then `request[SETTLE](usage)`, when a
    stage before this one set it, or `SETTLE(None)` for a request that is not billed (failed,
    or its row could not be recorded, which fails the request)."""
    if not callable(record):
        raise TypeError("billing_middleware: record must be an async callable")
    warned: set[tuple[str, str]] = set()  # (model, what its pricing does not price): logged once

    # (It sets request[LEDGER_ROW] too, but on the way out: no stage after it could read it.)
    @stage("billing", requires=(API_KEY, MODEL), reads=(SETTLE, ANSWERED_MODEL, DEPLOYMENT, SESSION))
    async def billing(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = datetime.now(UTC)
        reply = await handler(request)
        bill = Bill(request, started, record, warned)
        if isinstance(reply, MessageReply):
            await bill.record(reply.usage)
        elif isinstance(reply, EventStreamReply):
            reply.events = BilledEvents(reply.events, reply.usage, bill)
        else:  # a reply of another kind (a foreign handler's) has no usage to bill
            await bill.release()
        return reply

    return billing


class Bill:
    """What one request's ledger row needs, and recording it (the row is then `request[LEDGER_ROW]`)."""

    def __init__(
        self, request: web.Request, started: datetime, record: RecordRow, warned: set[tuple[str, str]]
    ) -> None:
        self._request, self._started, self._record, self._settle = request, started, record, request.get(SETTLE)
        self._warned = warned

    async def record(self, usage: Usage, outcome: Outcome = "complete") -> None:
        request = self._request
        asked = request[MODEL]
        answered = request.get(ANSWERED_MODEL, asked)
        deployment = request.get(DEPLOYMENT, "")
        pricing = pricing_at(answered, deployment)  # where it answered: deployments may differ in price
        row = LedgerRow(
            request_id=request_id(request),
            key_id=request[API_KEY].id,
            model=asked.id,
            answered_model=answered.id,
            deployment=deployment,
            input_tokens=usage.input_tokens,
            cache_write_tokens=usage.cache_write_tokens,
            cache_write_1h_tokens=usage.cache_write_1h_tokens,
            cache_read_tokens=usage.cache_read_tokens,
            output_tokens=usage.output_tokens,
            reasoning_tokens=usage.reasoning_tokens,
            cost_usd=usage.cost(pricing),  # priced as the model that answered, where it answered
            outcome=outcome,
            started_at=self._started,
            finished_at=datetime.now(UTC),
            session=LedgerRow.session_name(request.get(SESSION)),
        )
        if usage.estimated is not None and outcome == "complete":  # the answer ended, yet its count is wanting
            log.warning(
                "deployment %s sent an answer whose output count is %s: billed the estimate from its text, %d tokens",
                row.deployment,
                usage.estimated,
                usage.output_tokens,
            )
        # A deployment's own pricing is its own to warn of: it may lack what the model's has.
        whose = answered.id if pricing is answered.pricing else f"{answered.id} at deployment {deployment}"
        for unpriced in usage.unpriced(pricing):
            if (whose, unpriced) not in self._warned and len(self._warned) < WARNED_AT_MOST:
                self._warned.add((whose, unpriced))
                log.warning(
                    "model %s: the upstream's usage reports %s, which its pricing does not price: billed without it",
                    whose,
                    unpriced,
                )
        try:
            await self._record(row)
        except asyncio.CancelledError:
            # The client left while the row was being written; the gateway's ledger writes it
            # all the same, so the request is settled as used. (A store that does not leaves
            # its spend reservation to expire: held too long, never too short.)
            if self._settle is not None:
                await self._settle(usage)
            raise
        except BaseException:
            await self.release()  # not recorded, so not billed
            raise
        request[LEDGER_ROW] = row
        if self._settle is not None:
            await self._settle(usage)

    async def release(self) -> None:
        """The request is not billed: what admission reserved for it goes back (once)."""
        if self._settle is not None:
            await self._settle(None)


class BilledEvents:
    """The upstream's events, passed through unchanged; the row is recorded, from the stream's
    usage, before the batch that ends the stream goes on, so `[DONE]` follows the commit; the
    events that arrived with the end wait for it too, and a burst leaves in one write."""

    def __init__(self, events: EventStream, usage: StreamUsage, bill: Bill) -> None:
        self._events = events
        self.usage = usage  # the source's meter
        self._bill = bill
        self._settled = False  # billed, or failed and so never billed

    def __aiter__(self) -> BilledEvents:
        return self

    async def __anext__(self) -> Batch:
        batch = await self._events.__anext__()
        ending = ends_stream(batch)
        if ending == "message_stop":
            self._settled = True
            await self._bill.record(self.usage.total())
        elif ending == "error":
            self._settled = True  # failed requests are not billed
            await self._bill.release()
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
                await self._bill.record(self.usage.total(), "client_closed")
            else:
                await self._bill.release()  # failed, or settled already (then a no-op)
