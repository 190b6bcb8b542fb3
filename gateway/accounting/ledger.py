"""Group commit for the usage ledger (gateway/storage/group_commit.py): rows recorded while one batch
is being written go together in the next, so many concurrent requests cost one transaction, not
one each. A row alone is written at once by the request itself, when the store can do that
without waiting."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from gateway.ops.metrics import NO_METRICS, Metrics, NoMetrics
from gateway.storage import LedgerRow, Store
from gateway.storage.group_commit import MAX_GROUP, GroupCommit
from gateway.storage.unavailable import StoreUnavailable
from middlewares.core.errors import GatewayError

log = logging.getLogger("ezat.ledger")


class LedgerError(GatewayError):
    """A row that could not be written: the request it bills fails, since none goes unrecorded.
    Its own type, whatever the store raised: a ConnectionError would pass for the client's."""

    def __init__(self) -> None:
        super().__init__(
            500, "The gateway could not record this request's usage; it is not billed.", type="server_error"
        )


class Ledger:
    def __init__(
        self,
        store: Store,
        *,
        max_batch: int = MAX_GROUP,
        attempts: int = 3,
        metrics: Metrics | NoMetrics = NO_METRICS,
        committed: Callable[[Sequence[LedgerRow]], None] | None = None,
    ) -> None:
        """`committed(rows)`, when given, is told of each commit's rows (the alerts check spend)."""
        self._store = store
        self._on_commit = committed
        self._metrics = metrics
        self._max_batch = max_batch
        self._attempts = attempts
        self._pending: list[tuple[LedgerRow, asyncio.Future[None]]] = []
        self._commit = GroupCommit(self._write_batches)

    async def record(self, row: LedgerRow) -> None:
        """Returns once the row is committed. A caller cancelled meanwhile does not unwrite it:
        the batch goes on, so a reply that finished is never lost."""
        if self._commit.alone() and not self._pending:
            # Nothing to share a transaction with: written here and now, which spares a task, a
            # future and the event-loop turns between them, a cost a lone request would pay in full
            # (bench/HISTORY.md). The store does it only where nothing can wait or be cancelled.
            started = time.monotonic()
            try:
                written = self._store.write_ledger_now([row])
            except StoreUnavailable:  # the usual way below tries again (the outage is logged once)
                pass
            except Exception as exc:  # the usual way below tries again
                log.warning("ledger write of 1 row failed: %r", exc)
            else:
                if written:
                    self._commit.written_alone()
                    self._committed([row], started)
                    return
        done = asyncio.get_running_loop().create_future()
        self._pending.append((row, done))
        self._commit.start()
        await done  # cancelling the caller cancels only this future; _settle skips it

    async def close(self) -> None:
        """Wait for every recorded row to be written."""
        await self._commit.idle()

    async def _write_batches(self) -> None:
        while self._pending:
            await self._commit.linger()
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            self._commit.taken(len(batch))
            self._metrics.pending(len(batch) + len(self._pending))  # per batch: a scrape sees no finer
            await self._write(batch)
        self._metrics.pending(0)

    async def _write(self, batch: list[tuple[LedgerRow, asyncio.Future[None]]]) -> None:
        rows = [row for row, _ in batch]
        for attempt in range(1, self._attempts + 1):
            started = time.monotonic()
            try:
                await self._store.write_ledger(rows)
            except Exception as exc:  # the database may be briefly unavailable: try again
                if not isinstance(exc, StoreUnavailable):  # (an outage is logged once, as it starts and ends)
                    log.warning("ledger write of %d rows failed (attempt %d): %r", len(rows), attempt, exc)
                if attempt < self._attempts:
                    await asyncio.sleep(0.05 * 2**attempt)
                elif isinstance(exc, StoreUnavailable):  # no row of the batch is to blame: each request gets the 503
                    return _settle(batch, failed=exc.anew)
                elif len(batch) == 1:
                    return _settle(batch, failed=LedgerError)
            else:
                self._committed(rows, started)
                return _settle(batch, failed=None)
        # A batch that keeps failing may hold one bad row: it must not take its neighbours down.
        for entry in batch:
            started = time.monotonic()
            try:
                await self._store.write_ledger([entry[0]])
            except StoreUnavailable as exc:
                _settle([entry], failed=exc.anew)
            except Exception as exc:
                log.error("ledger row %s could not be written: %r", entry[0].request_id, exc)
                _settle([entry], failed=LedgerError)
            else:
                self._committed([entry[0]], started)
                _settle([entry], failed=None)

    def _committed(self, rows: list[LedgerRow], started: float) -> None:
        # A count or a check that fails must not fail the rows, which are written, nor the other.
        try:
            self._metrics.committed(rows, time.monotonic() - started)
        except Exception:
            log.exception("the ledger's metrics failed")
        if self._on_commit is not None:
            try:
                self._on_commit(rows)
            except Exception:
                log.exception("what follows the ledger's commit failed")


def _settle(batch: list[tuple[LedgerRow, asyncio.Future[None]]], *, failed: Callable[[], GatewayError] | None) -> None:
    """The batch's requests go on, or each fails with an error `failed` makes."""
    for _, done in batch:
        if not done.done():
            # An error each: a request's error becomes its response, which no other request may share.
            done.set_exception(failed()) if failed is not None else done.set_result(None)
