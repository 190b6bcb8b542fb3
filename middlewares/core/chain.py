"""Stages and their order.

Each stage is a new-style aiohttp middleware that says which request keys it requires (set by a
stage before it) and which it provides. `checked` looks at a chain before it serves: a stage
placed before the one that provides what it needs is an error at startup, naming both, never
a KeyError (a 500) on a request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from aiohttp import web

from middlewares.core.context import key_name


@dataclass(frozen=True)
class Stage:
    name: str
    requires: frozenset[web.RequestKey] = frozenset()
    provides: frozenset[web.RequestKey] = frozenset()


class ChainError(ValueError):
    """Stages in an order that cannot work."""


def stage(name: str, *, requires: Iterable[web.RequestKey] = (), provides: Iterable[web.RequestKey] = ()):
    """Make `fn(request, handler)` a new-style aiohttp middleware that declares its keys (a
    handler, which is no middleware, sets a `Stage` as its `stage` attribute itself)."""

    def declare(fn: Callable) -> Callable:
        fn = web.middleware(fn)
        fn.stage = Stage(name, frozenset(requires), frozenset(provides))
        return fn

    return declare


def checked(middlewares: Sequence[Callable], handler: Callable | None = None) -> list[Callable]:
    """`middlewares` (outermost first), after checking that each stage, and then `handler`,
    comes after the stages that provide what it requires. Middlewares that declare nothing
    (not ours) are passed over."""
    stages = [getattr(m, "stage", None) for m in middlewares]
    if handler is not None:
        stages.append(getattr(handler, "stage", None))
    provided: set[web.RequestKey] = set()
    for index, this in enumerate(stages):
        if this is None:
            continue
        for key in sorted(this.requires - provided, key=key_name):
            later = next((s.name for s in stages[index + 1 :] if s is not None and key in s.provides), None)
            needs = f"{this.name} needs the request's {key_name(key)}"
            if later:
                raise ChainError(f"{needs}, which {later} provides: put {later} before {this.name}")
            raise ChainError(f"{needs}, which no stage before it provides")
        provided |= this.provides
    return list(middlewares)
