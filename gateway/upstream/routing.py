"""Which deployment of a model gets a request.

Requests with an affinity (a conversation's name, or else the digest of the stable prompt
prefix: system prompt and tools, so apps sharing a long system prompt share its cache) go
to the deployment that ranks highest for it by rendezvous (highest-random-weight) hashing: every
replica computes the same order with no shared state, so a conversation finds its prompt cache
again; when its deployment fails only its conversations move, each to its own next choice.
Requests without one follow the model's preference order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import orjson


def ranked(deployments: Sequence[str], affinity: str | None) -> list[str]:
    if affinity is None:
        return list(deployments)
    return sorted(deployments, key=lambda name: _weight(affinity, name), reverse=True)


def _weight(affinity: str, deployment: str) -> int:
    # A session header's bytes that are not UTF-8 come as surrogates (aiohttp): hashed as they came.
    digest = hashlib.blake2b(f"{affinity}\0{deployment}".encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def affinity(session: str | None, body: dict[str, Any]) -> str | None:
    """What a request should stick by: its conversation, else its stable prefix, else nothing."""
    if session:
        return "session:" + session
    prefix = _unmarked(body.get("system")), _unmarked(body.get("tools"))
    if prefix == (None, None):
        return None
    try:
        return "prefix:" + hashlib.blake2b(orjson.dumps(prefix), digest_size=16).hexdigest()
    except orjson.JSONEncodeError:
        return None  # nested too deep to send anyway: the upstream call says so


def _unmarked(blocks: Any) -> Any:
    """System blocks or tools without their cache marks: whether a breakpoint was placed (by
    the client, or by the caching stage, which a header turns off) must not move a prefix."""
    if not isinstance(blocks, list):
        return blocks
    return [{k: v for k, v in b.items() if k != "cache_control"} if isinstance(b, dict) else b for b in blocks]
