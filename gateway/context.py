"""What one request carries from stage to stage: typed keys on the aiohttp request.

Every stage names here what it reads and writes, so the chain's data flow is in one place.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from aiohttp import web

from gateway.storage.records import KeyRecord

# The parsed JSON body. size_limit sets it; translator replaces the OpenAI request with the
# Anthropic one; the proxy handler sends it.
BODY = web.RequestKey("ezat.body", dict[str, Any])
# The size of the request body in bytes, set by size_limit.
BODY_BYTES = web.RequestKey("ezat.body_bytes", int)
# The conversation the request belongs to (`x-ezat-session`, else `prompt_cache_key`), set by
# cache_breakpoints; routing keeps a conversation on one deployment.
SESSION = web.RequestKey("ezat.session", str | None)
# The caller's key, set by auth.
API_KEY = web.RequestKey("ezat.api_key", KeyRecord)
# The request id: `chatcmpl-<id>` and the request-id / x-request-id response headers.
REQUEST_ID = web.RequestKey("ezat.request_id", str)
# Models to try, in order, when the asked one cannot answer (the request's `models`), set by translator.
FALLBACK_MODELS = web.RequestKey("ezat.fallback_models", tuple[str, ...])
# The model that answered (the asked one, or a fallback), set by the proxy handler.
ANSWERED_MODEL = web.RequestKey("ezat.answered_model", str)
# The deployment the proxy handler sent the request to.
DEPLOYMENT = web.RequestKey("ezat.deployment", str)


def request_id(request: web.Request) -> str:
    """The request's id, made on first use."""
    rid = request.get(REQUEST_ID)
    if rid is None:
        rid = request[REQUEST_ID] = new_request_id()
    return rid


# Ids must be unique, not secret: seeded from os.urandom, and again in a forked child.
_random = random.Random()
os.register_at_fork(after_in_child=_random.seed)


def new_request_id() -> str:
    """24 hex digits: the time in microseconds (13 digits, enough until 2112), then 44 random
    bits. A later id sorts later, so the ledger's unique index on it grows at its end; random
    ids would each touch another of its pages (an 8-row batch on a 100,000-row ledger: 102 µs
    against 61)."""
    return f"{time.time_ns() // 1000:013x}{_random.getrandbits(44):011x}"
