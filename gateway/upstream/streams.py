"""The app's register of open streams: it keeps quiet ones alive, and ends them on shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.ops.metrics import NO_METRICS, Metrics, NoMetrics
from middlewares.core.reply import EventStreamReply


class OpenStreams:
    """The app's open streams. It keeps quiet ones alive: one task for all of them writes a
    `: ping` comment into each stream that has sent nothing for `interval` seconds (the
    upstream silent, or busy with output the client never sees, such as thinking); one timer
    for all streams costs less than one per read, and a stream notes the time of its own
    writes. The same task drops the client of a stream whose write has waited
    `write_timeout` seconds (the client stopped reading). And it ends them all at once, when
    the gateway shuts down (`end_all_after`)."""

    def __init__(
        self, interval: float = 15.0, write_timeout: float = 30.0, metrics: Metrics | NoMetrics = NO_METRICS
    ) -> None:
        self.interval = interval
        self.write_timeout = write_timeout
        self._metrics = metrics
        self._streams: set[EventStreamReply] = set()
        self._pings: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._end: dict[str, Any] | None = None  # once set, every stream ends with it
        self._ending: asyncio.TimerHandle | None = None

    def watch(self, stream: EventStreamReply) -> None:
        self._streams.add(stream)
        # Set as it changes, not at a scrape: under --workers a scrape reads every worker's value.
        self._metrics.open_streams(len(self._streams))
        if self._end is not None:  # it started after the end of all: it ends at once too
            stream.stop(self._end)

    def done(self, stream: EventStreamReply) -> None:
        self._streams.discard(stream)
        self._metrics.open_streams(len(self._streams))

    def end_all_after(self, seconds: float, event: dict[str, Any]) -> None:
        """In `seconds`, end every open stream, and any that starts later, with `event` (an
        error): each then ends as a stream whose upstream failed does."""
        self._ending = asyncio.get_running_loop().call_later(seconds, self._end_all, event)

    def _end_all(self, event: dict[str, Any]) -> None:
        self._end = event
        for stream in list(self._streams):
            stream.stop(event)

    async def lifespan(self, app: web.Application):
        """aiohttp cleanup context: the pinging task lives as long as the app."""
        task = asyncio.create_task(self._ping_forever())
        yield
        task.cancel()
        if self._ending is not None:
            self._ending.cancel()

    async def _ping_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.interval / 2, self.write_timeout / 2))
            now = loop.time()
            for stream in list(self._streams):
                if stream.writing_since is not None:
                    if stream.writing_since <= now - self.write_timeout:
                        stream.abandon()
                elif stream.last_write <= now - self.interval:
                    stream.last_write = now
                    ping = asyncio.create_task(stream.ping())
                    self._pings.add(ping)
                    ping.add_done_callback(self._pings.discard)
