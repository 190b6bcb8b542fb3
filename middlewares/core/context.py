"""What one request carries from stage to stage: typed keys on the aiohttp request.

Every key is declared here, with the stage that sets it, so the chain's data flow is in one
place; each stage also declares the keys it requires and provides (`middlewares.core.chain`).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from middlewares.core.protocols import ModelSpec
from middlewares.core.records import KeyRecord, LedgerRow
from middlewares.core.usage import Usage

_NAMES: dict[web.RequestKey[Any], str] = {}


def _key(name: str, kind: Any) -> web.RequestKey[Any]:
    """A key named `ezat.<name>`; `kind`, a type or a typing form, is for its repr (what the key
    holds, to mypy, is the type its declaration gives it)."""
    key: web.RequestKey[Any] = web.RequestKey("ezat." + name, kind)
    _NAMES[key] = name
    return key


def key_name(key: web.RequestKey[Any]) -> str:
    """A key's short name, for messages: `body`, `model`…"""
    return _NAMES.get(key, repr(key))


# The parsed JSON body, a dict. size_limit sets it; the translator replaces the OpenAI request
# with the Anthropic one; the proxy handler sends it, and takes it away once an answer has begun
# (a prompt is not held while its answer streams), so a stage reads it before calling on. A
# foreign handler reads it here. A stage that changes it in place calls `body_changed` first
# (CLIENT_BYTES, below).
BODY: web.RequestKey[dict[str, Any]] = _key("body", dict[str, Any])
# The size of the request body in bytes, set by size_limit.
BODY_BYTES: web.RequestKey[int] = _key("body_bytes", int)


class ClientBytes(NamedTuple):
    """The bytes the client sent (decoded), and the very dict size_limit parsed them into."""

    body: dict[str, Any]
    data: bytes


# The body as the client sent it, set by size_limit beside BODY when told to keep it
# (`keep_client_bytes`) and the bytes are exactly orjson's writing of BODY (so they repeat no key
# the upstream could read otherwise), so that a handler can send the client's own bytes on
# rather than encode the body again; read it with `client_bytes(request)`, never directly. The contract, for every stage
# here and any other app's middleware: the bytes stand for BODY only while nothing has changed
# it. A stage that changes BODY's contents in place (adds, removes or replaces anything in it,
# at any depth) calls `body_changed(request)` before it does. Replacing BODY by another dict
# (the translators) is safe without it, since the bytes are tied to the dict they were parsed
# into and `client_bytes` gives none for another; calling it frees them sooner. A stage that
# changes the body in place and forgets is loud where the reader asks `client_bytes(request,
# check=True)` (the test suite's gateways do: `build_app(check_client_bytes=True)`): the bytes
# are then parsed again, and `StaleClientBytes` raised when they no longer make the body.
CLIENT_BYTES: web.RequestKey[ClientBytes] = _key("client_bytes", ClientBytes)
# The caller's key, set by auth.
API_KEY: web.RequestKey[KeyRecord] = _key("api_key", KeyRecord)
# The model the request asks for, resolved once, by limits.
MODEL: web.RequestKey[ModelSpec] = _key("model", ModelSpec)
# Models to try, in order, when the asked one cannot answer (the request's `models`), set by limits.
FALLBACK_MODELS: web.RequestKey[tuple[ModelSpec, ...]] = _key("fallback_models", tuple[ModelSpec, ...])
# Settles what admission reserved, set by limits: billing calls it with the usage it recorded,
# or with None for a request it does not bill. Only the first call counts.
SETTLE: web.RequestKey[Callable[[Usage | None], Awaitable[None]]] = _key(
    "settle", Callable[[Usage | None], Awaitable[None]]
)
# The conversation the request belongs to (`x-ezat-session`, else `prompt_cache_key`, or on
# Anthropic's API Claude Code's `X-Claude-Code-Session-Id`), as sent, set by cache_breakpoints;
# routing keeps a conversation on one deployment, and billing names it in the ledger row.
SESSION: web.RequestKey[str | None] = _key("session", str | None)
# The conversation's name a translation took out of the body (the Responses API's
# `prompt_cache_key`), set by the responses stage; cache_breakpoints, which reads the translated
# body, names the conversation by it when no `x-ezat-session` does.
CONVERSATION: web.RequestKey[str] = _key("conversation", str)
# The request id: `chatcmpl-<id>` and the request-id / x-request-id response headers.
REQUEST_ID: web.RequestKey[str] = _key("request_id", str)
# The model that answered (the asked one, or a fallback), set by the proxy handler.
ANSWERED_MODEL: web.RequestKey[ModelSpec] = _key("answered_model", ModelSpec)
# The deployment the proxy handler sent the request to.
DEPLOYMENT: web.RequestKey[str] = _key("deployment", str)
# The request's ledger row, set by billing once it is recorded (for the app's logs and metrics).
LEDGER_ROW: web.RequestKey[LedgerRow] = _key("ledger_row", LedgerRow)


class StaleClientBytes(RuntimeError):
    """A stage changed `request[BODY]` in place without calling `body_changed(request)`."""


def body_changed(request: web.Request) -> None:
    """What a stage calls before it changes `request[BODY]`'s contents in place: the client's
    bytes (`CLIENT_BYTES`) no longer stand for the body, and are let go."""
    request.pop(CLIENT_BYTES, None)


def client_bytes(request: web.Request, *, check: bool = False) -> bytes | None:
    """`request[BODY]`'s bytes as the client sent them, when nothing has changed it since
    size_limit parsed them (no stage called `body_changed`, and BODY is still the dict they were
    parsed into); None otherwise, and the body is to be encoded again. `check` proves they still
    make the body (a second parse and a deep comparison: several times what encoding the body
    costs, so for tests, not service)."""
    kept: ClientBytes | None = request.get(CLIENT_BYTES)
    if kept is None or kept.body is not request.get(BODY):
        return None
    if check and orjson.loads(kept.data) != kept.body:
        raise StaleClientBytes("request[BODY] was changed in place without body_changed(request)")
    return kept.data


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
    ids would each touch another of its pages, and a batch of rows would write many pages of
    the index where it now writes one or two."""
    return f"{time.time_ns() // 1000:013x}{_random.getrandbits(44):011x}"
