"""Who an admin token is, for the admin API and the console alike: a token declared in the
config by its digest (every one compared, in constant time), else one the CLI made and the store
keeps, unless it is revoked. And the failed attempts each client address has made, one count per
process for both, limited to `[admin] failed_attempts_per_minute`: past it, an address's wrong
tokens are refused without being counted, while a valid token is always accepted. (A guess at a
256-bit token is hopeless; what the limit must not allow is anyone, even a web page sending
requests from a browser behind the same proxy, locking the right token out.)"""

from __future__ import annotations

import hmac
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple

from aiohttp import web

from gateway.admin import changes
from gateway.config import AdminConfig
from gateway.storage import Store


class Holder(NamedTuple):
    """An admin token's holder: its name (the audit log's actor) and role, as they are now."""

    name: str
    role: str


class Refused(NamedTuple):
    """A token that is not a valid admin token, and the seconds its address must wait before its
    failures count again (0: none; the token was wrong)."""

    wait: int


class AdminTokens:
    def __init__(self, config: AdminConfig, store: Store) -> None:
        self._declared = [(bytes.fromhex(t.token_sha256), Holder(t.name, t.role)) for t in config.tokens]
        self._store = store
        self._failures = FailedAttempts(config.failed_attempts_per_minute)

    async def check(self, token: str, address: str) -> Holder | Refused:
        """The holder of `token`, however many failures `address` has made; else Refused, the
        failure counted unless the address is waiting already."""
        wait = self._failures.wait(address)
        holder = await self.holder(changes.digest(token))
        if holder is not None:
            return holder
        if not wait:
            self._failures.failed(address)
        return Refused(wait)

    async def holder(self, token_sha256: str) -> Holder | None:
        """The holder of the admin token with that digest (64 hex digits), if it is one and is
        not revoked. Looked up on every call: a token revoked is refused from then on."""
        presented = bytes.fromhex(token_sha256)
        found = None
        for digest, holder in self._declared:
            if hmac.compare_digest(digest, presented):
                found = holder
        if found is not None:
            return found
        stored = await self._store.find_admin_token(token_sha256)
        if stored is None or stored.revoked_at is not None:
            return None
        if not hmac.compare_digest(bytes.fromhex(stored.token_sha256), presented):
            return None
        return Holder(stored.name, stored.role)


class FailedAttempts:
    """Failed attempts per client address over the last minute, in this process: past `limit`,
    an address waits until the minute is over."""

    WINDOW = 60.0
    TRACKED = 10_000  # addresses kept; the oldest go first

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = limit
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def wait(self, address: str) -> int:
        """Seconds `address` must wait before it may try again; 0: it may now."""
        failures = self._failures.get(address)
        now = self._clock()
        while failures and now - failures[0] >= self.WINDOW:
            failures.popleft()
        if not failures or len(failures) < self._limit:
            return 0
        return max(1, math.ceil(self.WINDOW - (now - failures[0])))

    def failed(self, address: str) -> None:
        failures = self._failures.pop(address, None) or deque()
        failures.append(self._clock())
        self._failures[address] = failures  # the newest last
        while len(self._failures) > self.TRACKED:
            self._failures.popitem(last=False)


ADMIN_TOKENS = web.AppKey("admin_tokens", AdminTokens)


def admin_tokens(app: web.Application, config: AdminConfig, store: Store) -> AdminTokens:
    """The app's AdminTokens, made on first use, so that the admin API and the console count
    failures together."""
    if ADMIN_TOKENS not in app:
        app[ADMIN_TOKENS] = AdminTokens(config, store)
    return app[ADMIN_TOKENS]
