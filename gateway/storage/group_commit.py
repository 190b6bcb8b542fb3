"""When a group-commit writer writes, which the usage ledger and the spend reservations share:
what arrives while one group is being written goes in the next, in one transaction; a group
waits a couple of event-loop turns for company when the last one was shared (requests are
finishing, or arriving, together); and an arrival alone is written at once by its caller."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Coroutine
from typing import Any

# Loop turns a group waits for company when the last one was shared: requests finishing together
# then share a transaction rather than each taking the writer as it comes free, which costs every
# request less (bench/HISTORY.md).
LINGER_TURNS = 2
# An arrival is alone when the one before it came (or was committed) at least this long before:
# not one of a burst of requests, which had better share a transaction. Long enough that a busy
# gateway's arrivals, spread by the work between them and by the lone commits themselves, still
# count as busy: with a window shorter than a request's own CPU, one lone commit each kept them
# apart (bench/HISTORY.md, 2026-12-03).
ALONE_AFTER = 0.001
# The most one group takes (ledger rows, spend holds): a burst of thousands is written in several
# transactions, none long on the event loop.
MAX_GROUP = 2000


class GroupCommit:
    """Runs `write_groups` (which writes until nothing is pending) in one task at a time."""

    def __init__(self, write_groups: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._write_groups = write_groups
        self._writer: asyncio.Task[None] | None = None
        self._last_shared = False  # the group written last held more than one
        self._last_arrival = 0.0  # time.monotonic() of the last arrival, or of a lone write's commit

    def alone(self) -> bool:
        """Notes an arrival: whether it has nothing to share a transaction with (no group being
        written, the last not shared, none arrived just before). The caller checks that nothing
        is pending."""
        now = time.monotonic()
        alone, self._last_arrival = now - self._last_arrival >= ALONE_AFTER, now
        return alone and self._writer is None and not self._last_shared

    def written_alone(self) -> None:
        """A lone arrival was committed by its caller: one right behind it (of the same burst,
        say) is not alone, however long the commit took."""
        self._last_arrival = time.monotonic()

    def start(self) -> None:
        """Writes what is pending, unless a group is already being written (then what is
        pending goes with the next)."""
        if self._writer is None:
            # In a context of its own: not the first request's (its id, its span) that made it.
            self._writer = asyncio.create_task(self._writing(), context=contextvars.Context())

    async def linger(self) -> None:
        """Before a group is taken: while groups are shared, a few turns of the event loop let
        more arrivals share this one."""
        if self._last_shared:
            for _ in range(LINGER_TURNS):
                await asyncio.sleep(0)

    def taken(self, size: int) -> None:
        """A group of `size` was taken to be written."""
        self._last_shared = size > 1

    async def idle(self) -> None:
        """Returns when no group is being written."""
        while self._writer is not None:
            await asyncio.shield(self._writer)

    async def _writing(self) -> None:
        try:
            await self._write_groups()
        finally:
            self._writer = None
