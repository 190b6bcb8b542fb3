"""Spend reservations in groups (gateway/storage/group_commit.py): what requests ask to hold while one
group is being written go together in the next, so many concurrent admissions cost one
transaction, as the ledger's rows do (each transaction is a commit, and on SQLite a turn of the
file's one writer: admissions that arrive together need not wait for one each). A request alone
is written at once, by the request itself where the store can do that without waiting. Releases
wait for the next group: a reservation released a little late only holds back, for a moment,
what the key may spend."""

from __future__ import annotations

import asyncio
import logging
from decimal import Decimal

from gateway.storage import DEFAULT_ORGANIZATION_ID, Hold, Shortfall, Store
from gateway.storage.group_commit import MAX_GROUP, GroupCommit
from gateway.storage.unavailable import StoreUnavailable
from middlewares.core.errors import GatewayError

log = logging.getLogger("ezat.spending")


class SpendReservations:
    """The limits stage's `Spending`, over the store."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._holds: list[tuple[Hold, asyncio.Future[Shortfall | None]]] = []
        self._releases: list[str] = []
        self._commit = GroupCommit(self._write_groups)

    async def reserve(
        self,
        request_id: str,
        key_id: int,
        amount: Decimal,
        limit: Decimal | None,
        ttl: float,
        *,
        organization_id: int = DEFAULT_ORGANIZATION_ID,
        balance: Decimal | None = None,
        person_id: int | None = None,
        person_budget: Decimal | None = None,
        person_period: str = "month",
    ) -> Shortfall | None:
        hold = Hold(
            request_id, key_id, amount, limit, ttl, organization_id, balance, person_id, person_budget, person_period
        )
        if self._commit.alone() and not self._holds:
            # Nothing to share a transaction with (as the ledger's rows): held here and now, with
            # what releases wait, which spares a task, a future and the event-loop turns between
            # them. The store does it only where nothing can wait.
            releases, self._releases = self._releases, []
            try:
                results = self._store.hold_now([hold], releases)
            except StoreUnavailable:  # the usual way below tries again (the outage is logged once)
                results = None
            except Exception as exc:  # the usual way below tries again
                log.warning("spend reservation of 1 request failed: %r", exc)
                results = None
            if results is not None:
                self._commit.written_alone()
                return results[0]
            self._releases[:0] = releases
        done = asyncio.get_running_loop().create_future()
        self._holds.append((hold, done))
        self._commit.start()
        try:
            return await done
        except asyncio.CancelledError:
            self._releases.append(request_id)  # written or not, it holds nothing for a request gone
            self._commit.start()
            raise

    async def release(self, request_id: str) -> None:
        self._releases.append(request_id)
        self._commit.start()

    async def close(self) -> None:
        """Wait for what is pending to be written (releases a failed write kept get one more try)."""
        await self._commit.idle()
        if self._releases:
            self._commit.start()
            await self._commit.idle()

    async def _write_groups(self) -> None:
        while self._holds or self._releases:
            await self._commit.linger()
            # A request cancelled before its hold was written needs none (its release, queued
            # meanwhile, would run first and find nothing).
            taken, self._holds = self._holds[:MAX_GROUP], self._holds[MAX_GROUP:]
            group = [(hold, done) for hold, done in taken if not done.done()]
            self._commit.taken(len(group))
            releases, self._releases = self._releases, []
            try:
                results = await self._store.hold([hold for hold, _ in group], releases)
            except Exception as exc:
                # An outage is logged once, as it starts and ends; each request gets its 503.
                unavailable = exc.anew if isinstance(exc, StoreUnavailable) else None
                if unavailable is None:
                    log.error("spend reservations of %d requests could not be written: %r", len(group), exc)
                for _, done in group:
                    if not done.done():
                        done.set_exception(unavailable() if unavailable is not None else _unreserved())
                self._releases[:0] = releases  # tried again with the next group
                if not group:
                    break  # releases alone: the next reserve or release tries again, no busy loop
                continue
            for (_, done), left in zip(group, results):
                if not done.done():
                    done.set_result(left)


def _unreserved() -> GatewayError:
    # Its own error each: a request's error becomes its response, which no other may share.
    return GatewayError(500, "The gateway could not check this key's spend limit; try again.", type="server_error")
