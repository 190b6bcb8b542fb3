"""A store that cannot be reached: no unexpected error but an outage, which every route answers
with a 503 and `retry-after` in its API's envelope, and which the log tells once as it starts and
once as it ends (with how many requests it refused), not once a request.

Each store names the errors its driver raises when its database is gone (`raises_unavailable`);
its methods then raise `StoreUnavailable` for them. The app's error guard hands each refusal to
`StoreOutage`, which logs, counts, and watches for the database's return."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from middlewares.core.errors import GatewayError, retry_after

log = logging.getLogger("ezat.storage")

# Seconds between the watch's pings while the database is unavailable, and the most one may take.
WATCH_EVERY = 0.5
PING_TIMEOUT = 2.0
# Seconds a client is asked to wait: about as long as the watch takes to see the database back.
RETRY_AFTER = 1
# Seconds without a refusal before an outage whose database answers the ping is over: a database
# that reads but cannot write (a disk full, a lock held) answers the ping while writes still fail.
QUIET_FOR = 2.0
# Methods not wrapped: opening and closing, where the driver's own error says more (the address).
_UNWRAPPED = frozenset({"open", "close"})

S = TypeVar("S")


class StoreUnavailable(GatewayError):
    """The store's database cannot be reached (its cause: the driver's error). A 503 on every
    API; on Anthropic's too (an `api_error`): an overload, 529, would blame the model."""

    quiet = True  # StoreOutage logs the outage, once

    def __init__(self) -> None:
        super().__init__(
            503,
            "The gateway's database is unavailable; try again shortly.",
            type="server_error",
            code="store_unavailable",
            headers=retry_after(RETRY_AFTER),
            anthropic=(503, "api_error"),
        )

    def anew(self) -> StoreUnavailable:
        """The same error, its own: a request's error becomes its response, which none may share."""
        error = StoreUnavailable()
        error.__cause__ = self.__cause__
        return error


def raises_unavailable(unreachable: Callable[[BaseException], bool]) -> Callable[[type[S]], type[S]]:
    """A class decorator for a store: its public methods raise StoreUnavailable, from the driver's
    error, for each error `unreachable` says means the database cannot be reached."""

    def guarded(method: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(method):

            @functools.wraps(method)
            async def calling(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await method(*args, **kwargs)
                except Exception as exc:
                    if unreachable(exc):
                        raise StoreUnavailable() from exc
                    raise

            return calling

        @functools.wraps(method)
        def called(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except Exception as exc:
                if unreachable(exc):
                    raise StoreUnavailable() from exc
                raise

        return called

    def decorate(cls: type[S]) -> type[S]:
        for name, member in list(vars(cls).items()):
            if not name.startswith("_") and name not in _UNWRAPPED and inspect.isfunction(member):
                setattr(cls, name, guarded(member))
        return cls

    return decorate


class StoreOutage:
    """The refusals of one outage: the first logs that it began, each is counted (`counted()`,
    a metric), and a watch pings the store until it answers and nothing has been refused for
    QUIET_FOR seconds, then logs that it ended and how many requests it refused."""

    def __init__(self, ping: Callable[[], Any], *, counted: Callable[[], None]) -> None:
        self._ping, self._counted = ping, counted
        self._refused = 0
        self._since = 0.0  # time.monotonic() when it began
        self._last = 0.0  # time.monotonic() of its latest refusal
        self._watch: asyncio.Task[None] | None = None

    def refused(self, error: StoreUnavailable) -> StoreUnavailable:
        """A request refused for `error`: the error it gets, its own."""
        self._counted()
        self._refused += 1
        self._last = time.monotonic()
        if self._watch is None:
            cause = error.__cause__
            log.error(
                "the gateway's database is unavailable (%s): requests that need it get 503 until it answers again",
                f"{type(cause).__name__}: {cause}" if cause is not None else "no answer",
            )
            self._since = time.monotonic()
            # In a context of its own: not the first refused request's (its id).
            self._watch = asyncio.get_running_loop().create_task(self._watching(), context=contextvars.Context())
        return error.anew()

    async def _watching(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY)
            try:
                async with asyncio.timeout(PING_TIMEOUT):
                    await self._ping()
            except Exception:
                continue
            if time.monotonic() - self._last < QUIET_FOR:
                continue  # it answers, but requests were still refused a moment ago
            log.warning(
                "the gateway's database answers again after %.1f s; %d requests were refused meanwhile",
                time.monotonic() - self._since,
                self._refused,
            )
            self._refused, self._watch = 0, None
            return

    async def lifespan(self, app: web.Application):
        """aiohttp cleanup_ctx: a watch still running when the app stops ends with it, said so."""
        yield
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            log.warning(
                "the gateway stops with its database still unavailable; %d requests were refused", self._refused
            )
