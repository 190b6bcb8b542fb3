"""Stages and their order.

A stage is a new-style aiohttp middleware that says which request keys it requires (set by a
stage before it), which it provides, and which it reads when a stage has set them. `checked`
looks at a chain before it serves: a stage placed before the one that provides what it needs,
or what it reads, is an error at startup, naming both, never a KeyError (a 500) on a request,
nor a key silently missed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from middlewares.core.context import key_name

__all__ = ["ChainError", "Endpoint", "Keys", "Stage", "checked", "stage"]

log = logging.getLogger("ezat.chain")

# What a stage does with a request: `fn(request, handler)`, calling `handler` to go on.
StageFunction = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
RequestKeys = frozenset[web.RequestKey[Any]]


@dataclass(frozen=True)
class Keys:
    """What a stage, or a handler, declares: its name and the request keys it requires (an
    earlier stage must set them), provides, and reads (optional: used when an earlier stage set
    them, done without otherwise)."""

    name: str
    requires: RequestKeys = frozenset()
    provides: RequestKeys = frozenset()
    reads: RequestKeys = frozenset()


@dataclass(frozen=True)
class Stage:
    """A stage: its keys, and `fn`, which it is when aiohttp calls it (an ordinary new-style
    middleware, which any aiohttp app mounts)."""

    keys: Keys
    fn: StageFunction

    __middleware_version__: ClassVar[int] = 1  # what aiohttp looks for in a new-style middleware

    def __call__(self, request: web.Request, handler: Handler) -> Awaitable[web.StreamResponse]:
        return self.fn(request, handler)  # the stage's own coroutine: no second one per request


@dataclass(frozen=True)
class Endpoint:
    """A handler that declares its keys as a stage does (the gateway's proxy): `handle` is what
    aiohttp calls."""

    keys: Keys
    handle: Handler


class ChainError(ValueError):
    """Stages in an order that cannot work."""


def stage(
    name: str,
    *,
    requires: Iterable[web.RequestKey[Any]] = (),
    provides: Iterable[web.RequestKey[Any]] = (),
    reads: Iterable[web.RequestKey[Any]] = (),
) -> Callable[[StageFunction], Stage]:
    """Make `fn(request, handler)` a `Stage` that declares its keys."""

    def declare(fn: StageFunction) -> Stage:
        return Stage(Keys(name, frozenset(requires), frozenset(provides), frozenset(reads)), fn)

    return declare


def checked(middlewares: Sequence[Middleware], handler: Endpoint | None = None) -> list[Middleware]:
    """`middlewares` (outermost first), after checking that each stage, and then `handler`,
    comes after the stages that provide what it requires or reads. A key read that no stage
    provides is done without (it is logged); one that only the handler provides is read on the
    way out. Middlewares that are no `Stage` (not ours) are passed over."""
    stages = [m.keys for m in middlewares if isinstance(m, Stage)]
    if handler is not None:
        stages.append(handler.keys)
    provided: set[web.RequestKey[Any]] = set()
    for index, this in enumerate(stages):
        later_stages = stages[index + 1 : None if handler is None else -1]
        for key in sorted(this.requires - provided, key=key_name):
            _out_of_order(this, key, "needs", later_stages)
            raise ChainError(f"{this.name} needs the request's {key_name(key)}, which no stage before it provides")
        for key in sorted(this.reads - provided - this.provides, key=key_name):  # its own: set before read
            _out_of_order(this, key, "reads", later_stages)
            if handler is None or key not in handler.keys.provides:
                log.debug("%s reads the request's %s, which no stage provides here", this.name, key_name(key))
        provided |= this.provides
    return list(middlewares)


def _out_of_order(this: Keys, key: web.RequestKey[Any], verb: str, later: Sequence[Keys]) -> None:
    """A ChainError when a stage after `this` provides `key`."""
    provider = next((s.name for s in later if key in s.provides), None)
    if provider is not None:
        raise ChainError(
            f"{this.name} {verb} the request's {key_name(key)}, which {provider} provides: "
            f"put {provider} before {this.name}"
        )
