"""What a provider is to the upstream client: how a deployment's request is addressed, signed
and encoded, and how its answers read as Anthropic's. The client and the stages never branch on
which provider it is; each provider is a module of its own (anthropic, bedrock, vertex)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aiohttp
import orjson
from multidict import CIMultiDictProxy
from yarl import URL

from gateway.config import Deployment
from gateway.upstream.errors import upstream_error
from middlewares.core.errors import GatewayError, too_deeply_nested

log = logging.getLogger("ezat.upstream")

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
Lines = Sequence[tuple[str, str]]  # header lines: (lower-cased name, value)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ClientBytes:
    """A request as the client's own bytes, which nothing changed (sent as they are where the
    upstream speaks Anthropic's API), beside the request they parse to (for one that does not)."""

    raw: bytes
    parsed: dict[str, Any]


UpstreamBody = dict[str, Any] | ClientBytes  # a request to encode, or the client's own


def parsed(body: UpstreamBody) -> dict[str, Any]:
    """The request `body` is, parsed."""
    return body.parsed if isinstance(body, ClientBytes) else body


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One HTTP request to a deployment."""

    url: URL
    headers: Mapping[str, str] | Lines
    data: bytes


class Provider:
    """A deployment's provider."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=deployment.connect_timeout_seconds)

    async def outgoing(self, body: UpstreamBody, path: str, headers: Lines, query: Mapping[str, str]) -> Outgoing:
        """The request for `body` to `path` (MESSAGES or COUNT_TOKENS, as Anthropic's API names
        them); `headers` and `query` are what a client of Anthropic's API sent with it."""
        raise NotImplementedError

    def decoder(self) -> Callable[[bytes], bytes] | None:
        """A stream body's bytes as Anthropic's SSE, read by read (None: they are)."""
        return None

    def answer(self, path: str, raw: bytes, headers: CIMultiDictProxy[str]) -> bytes:
        """A whole 2xx answer as Anthropic's API gives it."""
        return raw

    def error(self, status: int, body: bytes, headers: CIMultiDictProxy[str], path: str) -> GatewayError:
        """A non-2xx answer to `path`, as the error the client gets."""
        return upstream_error(status, body, headers)


class CountUnsupported(GatewayError):
    """The deployment counts no tokens for this model: the gateway estimates the count."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def encoded(body: dict[str, Any]) -> bytes:
    """`body` as JSON. An exact copy: orjson's result keeps the whole buffer it was written in,
    often many times its length, and a request would hold that until its body is sent."""
    try:
        return bytes(memoryview(orjson.dumps(body)))
    except orjson.JSONEncodeError:
        raise too_deeply_nested() from None


def beta_flags(headers: Lines) -> list[str]:
    """The flags of a client's `anthropic-beta` lines, in order, each once."""
    flags = (flag.strip() for name, value in headers if name == "anthropic-beta" for flag in value.split(","))
    return list(dict.fromkeys(flag for flag in flags if flag))


class KeptBetas:
    """The beta flags a deployment takes: the rest are dropped, each logged once."""

    def __init__(self, deployment: Deployment, default: frozenset[str] | None) -> None:
        self._deployment = deployment.name
        self._allowed = frozenset(deployment.betas) if deployment.betas is not None else default
        self._dropped: set[str] = set()

    def __call__(self, flags: list[str]) -> list[str]:
        if self._allowed is None:
            return flags
        kept = [flag for flag in flags if flag in self._allowed]
        if len(kept) < len(flags):
            for flag in flags:
                if flag not in self._allowed and flag not in self._dropped and len(self._dropped) < 100:
                    self._dropped.add(flag)
                    log.info("deployment %s does not take the beta flag %r: dropped", self._deployment, flag[:100])
        return kept


class SingleFlight(Generic[T]):
    """A blocking call (finding or refreshing a credential) run in a thread, once at a time:
    whoever needs it while it runs waits for that run. A waiter that gives up (its deadline)
    does not cancel the run, so no second one starts beside it on the same credential."""

    def __init__(self, call: Callable[[], T]) -> None:
        self._call = call
        self._running: asyncio.Future[T] | None = None

    def start(self) -> asyncio.Future[T]:
        """The run under way, or a new one."""
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(asyncio.to_thread(self._call))
            self._running.add_done_callback(_retrieved)
        return self._running

    async def __call__(self) -> T:
        return await asyncio.shield(self.start())


def _retrieved(run: asyncio.Future[Any]) -> None:
    """A run's failure is its waiters' to report; one nobody waited for is not left unread."""
    if not run.cancelled():
        run.exception()
