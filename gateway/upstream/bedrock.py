"""Claude on Amazon Bedrock: InvokeModel, InvokeModelWithResponseStream and CountTokens.

The body is Anthropic's without `model` (the path names it) and `stream` (so does the path),
with Bedrock's `anthropic_version` and the kept beta flags as `anthropic_beta`. Requests are
signed with SigV4 from AWS's credential chain (botocore's: environment, shared files and
profiles, web identity, container and instance roles, SSO; refreshed before they expire, off
the event loop), or carry a Bedrock API key as a Bearer token. A stream's
application/vnd.amazon.eventstream frames become Anthropic's SSE events, read by read.
"""

from __future__ import annotations

import logging
import struct
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import orjson
import pybase64
from botocore.session import Session
from multidict import CIMultiDictProxy
from yarl import URL

from gateway.config import Deployment
from gateway.upstream import sigv4
from gateway.upstream.errors import upstream_error
from gateway.upstream.provider import (
    COUNT_TOKENS,
    CountUnsupported,
    KeptBetas,
    Lines,
    Outgoing,
    Provider,
    SingleFlight,
    UpstreamBody,
    beta_flags,
    encoded,
    parsed,
)
from middlewares.core.errors import GatewayError

log = logging.getLogger("ezat.upstream")

BEDROCK_VERSION = "bedrock-2023-05-31"
SERVICE = "bedrock"
# The beta flags Bedrock takes for Claude (it refuses a request with any other: "invalid beta flag").
BEDROCK_BETAS = frozenset(
    {
        "computer-use-2024-10-22",
        "computer-use-2025-01-24",
        "computer-use-2025-11-24",
        "token-efficient-tools-2025-02-19",
        "interleaved-thinking-2025-05-14",
        "output-128k-2025-02-19",
        "dev-full-thinking-2025-05-14",
        "context-1m-2025-08-07",
        "context-management-2025-06-27",
        "effort-2025-11-24",
        "fine-grained-tool-streaming-2025-05-14",
        "tool-search-tool-2025-10-19",
        "tool-examples-2025-10-29",
        "mid-conversation-system-2026-04-07",
    }
)
# An exception's name (x-amzn-ErrorType, or a stream's :exception-type, capitalised) as the
# Anthropic error it is: (status, type).
ERRORS = {
    "ValidationException": (400, "invalid_request_error"),
    "AccessDeniedException": (403, "permission_error"),
    "ResourceNotFoundException": (404, "not_found_error"),
    "ModelTimeoutException": (504, "timeout_error"),
    "ModelErrorException": (500, "api_error"),
    "ModelStreamErrorException": (529, "overloaded_error"),
    "ThrottlingException": (429, "rate_limit_error"),
    "ModelNotReadyException": (429, "rate_limit_error"),
    "ServiceQuotaExceededException": (429, "rate_limit_error"),
    "InternalServerException": (500, "api_error"),
    "ServiceUnavailableException": (529, "overloaded_error"),
}
# The exceptions that say the gateway's own AWS credentials failed (as a 401 does): its error,
# another deployment tried. An AccessDeniedException is the request's or the model's (a model
# the account may not use, cache_control where the model has no caching): the client's 403,
# nothing cooled; but one that speaks of authentication is a Bedrock API key refused.
_CREDENTIAL_ERRORS = frozenset(
    {
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "IncompleteSignatureException",
        "MissingAuthenticationTokenException",
        "ExpiredTokenException",
        "InvalidClientTokenId",
    }
)
_HEADERS = {"content-type": "application/json", "accept": "application/json"}
# The body's fields the gateway sets (the path names the model, and whether it streams):
# a client's own anthropic_beta would pass flags Bedrock refuses.
_SET_HERE = frozenset({"model", "stream", "anthropic_version", "anthropic_beta"})


class Bedrock(Provider):
    def __init__(self, deployment: Deployment) -> None:
        super().__init__(deployment)
        self._betas = KeptBetas(deployment, BEDROCK_BETAS)
        self._signer = None if deployment.api_key else _Signer(deployment)

    async def outgoing(self, body: UpstreamBody, path: str, headers: Lines, query: Mapping[str, str]) -> Outgoing:
        request = parsed(body)
        invoke = {k: v for k, v in request.items() if k not in _SET_HERE}
        invoke["anthropic_version"] = BEDROCK_VERSION
        if betas := self._betas(beta_flags(headers)):
            invoke["anthropic_beta"] = betas
        model = quote(str(request.get("model")), safe=":")  # as AWS's SDKs write it; an ARN's "/" encoded
        if path == COUNT_TOKENS:
            action = "count-tokens"
            invoke.setdefault("max_tokens", _count_max_tokens(invoke))
            # The InvokeModel body is a blob: base64 in JSON, as AWS's SDKs send it.
            data = encoded({"input": {"invokeModel": {"body": pybase64.b64encode(encoded(invoke)).decode()}}})
        else:
            action = "invoke-with-response-stream" if request.get("stream") else "invoke"
            data = encoded(invoke)
        url = URL(f"{self.deployment.base_url}/model/{model}/{action}", encoded=True)
        if self._signer is None:
            return Outgoing(url, {**_HEADERS, "authorization": f"Bearer {self.deployment.api_key}"}, data)
        return Outgoing(url, await self._signer.signed(url, data), data)

    def decoder(self) -> Callable[[bytes], bytes]:
        return EventStreamDecoder()

    def answer(self, path: str, raw: bytes, headers: CIMultiDictProxy[str]) -> bytes:
        """CountTokens' {"inputTokens"} as Anthropic's count; a message as it is, its usage
        from Bedrock's token-count headers if it has none."""
        if path != COUNT_TOKENS and (b'"usage"' in raw or "x-amzn-bedrock-input-token-count" not in headers):
            return raw  # as Bedrock answers: nothing to add, nothing parsed
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
        if not isinstance(answer, dict):
            return raw
        if path == COUNT_TOKENS:
            return orjson.dumps({"input_tokens": answer.get("inputTokens")})
        answer["usage"] = _usage_from(headers)
        return orjson.dumps(answer)

    def error(self, status: int, body: bytes, headers: CIMultiDictProxy[str], path: str) -> GatewayError:
        """Bedrock's exception as Anthropic's error; its message as written (Claude Code matches
        on a ValidationException's words to recover)."""
        name = headers.get("x-amzn-ErrorType", "").partition(":")[0]
        try:
            answer = orjson.loads(body)
            message = str(answer.get("message") or answer.get("Message") or name or "upstream error")
        except (orjson.JSONDecodeError, AttributeError):
            message = body[:200].decode("utf-8", "replace").strip() or name or "upstream error"
        if (
            status == 401
            or name in _CREDENTIAL_ERRORS
            or (name == "AccessDeniedException" and _authentication(message))
        ):
            log.error("Bedrock refused deployment %s's credentials: %s: %s", self.deployment.name, name, message[:200])
            return GatewayError(500, "The upstream rejected the gateway's credentials.", type="server_error")
        if path == COUNT_TOKENS and status == 400 and "support" in message and "count" in message.lower():
            return CountUnsupported(message)
        if name == "AccessDeniedException":
            log.warning("Bedrock refused deployment %s a request: %s", self.deployment.name, message[:200])
        status, kind = ERRORS.get(name, (status, None))
        anthropic = {"type": "error", "error": {"type": kind, "message": message} if kind else {"message": message}}
        return upstream_error(status, orjson.dumps(anthropic), headers)


def _authentication(message: str) -> bool:
    """An AccessDeniedException's message says a Bedrock API key was refused."""
    lowered = message.lower()
    return "api key" in lowered or "authenticat" in lowered


def _count_max_tokens(invoke: dict[str, Any]) -> int:
    """The max_tokens a count's InvokeModel body gets (a count has none, the body needs one):
    above its thinking budget, which Bedrock requires to be less than max_tokens."""
    thinking = invoke.get("thinking")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    return budget + 1 if type(budget) is int and budget > 0 else 1


def _usage_from(headers: Mapping[str, str]) -> dict[str, int]:
    names = {
        "input_tokens": "x-amzn-bedrock-input-token-count",
        "output_tokens": "x-amzn-bedrock-output-token-count",
        "cache_read_input_tokens": "x-amzn-bedrock-cache-read-input-token-count",
        "cache_creation_input_tokens": "x-amzn-bedrock-cache-write-input-token-count",
    }
    return {field: int(value) for field, name in names.items() if _count(value := headers.get(name, ""))}


def _count(value: str) -> bool:
    """A header's value is a token count (ASCII digits, few of them: int() takes them)."""
    return 0 < len(value) <= 12 and value.isascii() and value.isdigit()


class _Signer:
    """SigV4 for one deployment, from AWS's credential chain (or its aws_profile). Finding the
    credentials and refreshing temporary ones do I/O: both run in a thread, one run at a time.
    In botocore's advisory window (15 minutes before they expire) one refresh runs in the
    background while the current keys still sign; only in its mandatory window (10 minutes)
    does a request wait for it. A refresh that failed is not tried again for a while."""

    def __init__(self, deployment: Deployment) -> None:
        self._deployment = deployment
        self._credentials: Any = None
        self._frozen: Any = None  # the keys the last run got
        self._run = SingleFlight(self._refreshed)
        self._next_background = 0.0  # monotonic time
        self._keys = sigv4.SigningKeys()

    async def signed(self, url: URL, data: bytes) -> dict[str, str]:
        frozen = await self._current()
        credentials = sigv4.Credentials(frozen.access_key, frozen.secret_key, frozen.token)
        return sigv4.signed_headers(url, _HEADERS, data, credentials, self._deployment.region, SERVICE, self._keys)

    async def _current(self) -> Any:
        credentials = self._credentials
        if credentials is not None and not _refresh_needed(credentials):
            return credentials.get_frozen_credentials()  # no I/O while no refresh is due
        if self._frozen is not None and not _refresh_needed(credentials, MANDATORY_REFRESH_SECONDS):
            if (now := time.monotonic()) >= self._next_background:
                self._next_background = now + BACKGROUND_RETRY_SECONDS
                self._run.start()
            return self._frozen
        try:
            return await self._run()
        except Exception as error:  # botocore's, STS's ClientError, the files' OSError: any
            log.error("deployment %s: no usable AWS credentials: %s", self._deployment.name, error)
            raise GatewayError(
                500, "The gateway has no usable credentials for the upstream.", type="server_error"
            ) from None

    def _refreshed(self) -> Any:
        """In a thread: the credentials found (once), their keys refreshed if due."""
        if self._credentials is None:
            credentials = Session(profile=self._deployment.aws_profile or None).get_credentials()
            if credentials is None:
                raise ValueError("none found in the environment, the shared files, or a role")
            self._credentials = credentials
        self._frozen = self._credentials.get_frozen_credentials()
        return self._frozen


# botocore refreshes temporary credentials 15 minutes before they expire (advisory: a failure
# keeps the old ones) and must within 10 (mandatory); a background refresh that failed waits this
# long before another.
MANDATORY_REFRESH_SECONDS = 600
BACKGROUND_RETRY_SECONDS = 30.0


def _refresh_needed(credentials: Any, within: int | None = None) -> bool:
    """Temporary credentials are due a refresh (within botocore's advisory window, or `within`
    seconds of expiring); static ones never are."""
    refresh_needed = getattr(credentials, "refresh_needed", None)  # temporary ones have it
    return bool(refresh_needed is not None and refresh_needed(within))


# --- Event-stream frames -------------------------------------------------------------------

# The most a frame may be: Bedrock's are a few KB; more is not an event stream.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# A header's value length by type; byte arrays and strings (6, 7) carry their own (2 bytes).
_VALUE_LENGTHS = {0: 0, 1: 0, 2: 1, 3: 2, 4: 4, 5: 8, 8: 8, 9: 16}
_CUT = b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"The upstream sent a frame the gateway cannot read."}}\n\n'
_PRELUDE = struct.Struct("!III")
_CRC = struct.Struct("!I")
# Header sets already read, by their bytes (`_headers`); read-only once stored, a few at most.
_SEEN_HEADERS: dict[bytes, dict[str, str]] = {}
_SEEN_HEADERS_MAX = 16
_METRICS = b'"amazon-bedrock-invocationMetrics"'


class EventStreamDecoder:
    """application/vnd.amazon.eventstream, read by read, as Anthropic's SSE: each `chunk`
    event's Anthropic event (base64 in its payload) as `event: <type>\\ndata: <json>\\n\\n`, an
    `exception` as Anthropic's `error` event. Both CRCs are checked; a frame that fails (or a
    stream that is not frames) ends the stream with an error. The invocation metrics Bedrock adds
    to message_stop are taken out, and stand for the usage of a message_delta that has none."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._broken = False
        self._held: dict[str, Any] | None = None  # a message_delta without usage, until message_stop

    def __call__(self, chunk: bytes) -> bytes:
        if self._broken:
            return b""
        # The frames are read from the chunk itself; only a frame cut between reads is kept, in
        # the buffer, until the reads that complete it.
        buffer = self._buffer
        if buffer:
            buffer += chunk
            data: bytes | bytearray = buffer
        else:
            data = chunk
        view = memoryview(data)
        out: list[bytes] = []
        start, size = 0, len(data)
        failure = None
        try:
            while size - start >= 12:
                total, headers_length, prelude_crc = _PRELUDE.unpack_from(data, start)
                if (
                    zlib.crc32(view[start : start + 8]) != prelude_crc
                    or not 16 <= total <= MAX_FRAME_BYTES
                    or headers_length > total - 16
                ):
                    failure = "an event-stream prelude that does not check"
                    break
                end = start + total
                if end > size:
                    break
                if zlib.crc32(view[start : end - 4]) != _CRC.unpack_from(data, end - 4)[0]:
                    failure = "an event-stream message that does not check"
                    break
                payload_at = start + 12 + headers_length
                raw_headers = bytes(view[start + 12 : payload_at])
                headers = _SEEN_HEADERS.get(raw_headers) or _headers(raw_headers)
                if headers is None:
                    failure = "event-stream headers it cannot read"
                    break
                event = self._event(headers, bytes(view[payload_at : end - 4]))
                if event is None:
                    failure = "an event-stream message it cannot read"
                    break
                out.append(event)
                start = end
        finally:
            view.release()  # before the buffer changes size
        if failure is not None:
            return self._fail(out, failure)
        if data is buffer:
            del buffer[:start]
        elif start < size:
            buffer += chunk[start:]
        return b"".join(out)

    def _event(self, headers: dict[str, str], payload: bytes) -> bytes | None:
        kind = headers.get(":message-type")
        if kind == "exception" or kind == "error":
            name = headers.get(":exception-type") or headers.get(":error-code") or ""
            return _sse_error(name, payload, headers.get(":error-message"))
        if kind != "event" or headers.get(":event-type") != "chunk":
            return b""  # an event Bedrock may add that carries no Anthropic event
        data = _chunk_bytes(payload)
        if data is None:
            return None
        if data.startswith(b'{"type":"'):  # as Anthropic writes events: no parse to name one
            type_ = data[9 : data.find(b'"', 9)]
        else:
            try:
                type_ = str(orjson.loads(data)["type"]).encode()
            except (orjson.JSONDecodeError, KeyError, TypeError):
                return None
        try:
            if type_ == b"message_delta" and b'"usage"' not in data:
                self._held = orjson.loads(data)
                return b""
            if type_ == b"message_stop" and (_METRICS in data or self._held is not None):
                return self._stop(orjson.loads(data))
        except orjson.JSONDecodeError:
            return None
        return b"event: " + type_ + b"\ndata: " + data + b"\n\n"

    def _stop(self, stop: Any) -> bytes | None:
        if not isinstance(stop, dict):
            return None
        metrics = stop.pop("amazon-bedrock-invocationMetrics", None)
        before = b""
        if self._held is not None:
            if isinstance(metrics, dict):
                self._held["usage"] = {
                    field: metrics[name]
                    for field, name in (
                        ("input_tokens", "inputTokenCount"),
                        ("output_tokens", "outputTokenCount"),
                        ("cache_read_input_tokens", "cacheReadInputTokenCount"),
                        ("cache_creation_input_tokens", "cacheWriteInputTokenCount"),
                    )
                    if type(metrics.get(name)) is int
                }
            before = b"event: message_delta\ndata: " + orjson.dumps(self._held) + b"\n\n"
            self._held = None
        return before + b"event: message_stop\ndata: " + orjson.dumps(stop) + b"\n\n"

    def _fail(self, out: list[bytes], what: str) -> bytes:
        log.warning("Bedrock sent %s", what)
        self._broken = True
        self._buffer.clear()
        return b"".join(out) + _CUT


def _chunk_bytes(payload: bytes) -> bytes | None:
    """A `chunk` event's Anthropic event: its payload's `bytes`, base64-decoded. Bedrock writes
    the payload as {"bytes":"…"} or {"bytes":"…","p":"…"} (padding that hides the event's
    length): then the base64 is taken from between its quotes, unparsed (the frame's checksum
    has vouched for the bytes, and base64 holds no quote). Any other JSON is parsed."""
    try:
        if payload.startswith(b'{"bytes":"'):
            end = payload.find(b'"', 10)
            encoded = payload[10:end]
            if end > 0 and payload[end + 1 : end + 2] in (b"}", b",") and b"\\" not in encoded:
                return pybase64.b64decode(encoded, validate=True)
        return pybase64.b64decode(orjson.loads(payload)["bytes"], validate=True)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):  # binascii.Error is a ValueError
        return None


def _headers(raw: bytes) -> dict[str, str] | None:
    """An event-stream message's headers; only string values are kept (the rest are skipped).
    The first few sets read are kept by their bytes: Bedrock sends the same few on every frame."""
    headers = _read_headers(raw)
    if headers is not None and len(_SEEN_HEADERS) < _SEEN_HEADERS_MAX:
        _SEEN_HEADERS[raw] = headers
    return headers


def _read_headers(raw: bytes) -> dict[str, str] | None:
    headers = {}
    at, end = 0, len(raw)
    try:
        while at < end:
            name_length = raw[at]
            name = raw[at + 1 : at + 1 + name_length].decode()
            at += 1 + name_length
            type_ = raw[at]
            at += 1
            if type_ in (6, 7):
                length = int.from_bytes(raw[at : at + 2], "big")
                if type_ == 7:
                    headers[name] = raw[at + 2 : at + 2 + length].decode()
                at += 2 + length
            else:
                at += _VALUE_LENGTHS[type_]
    except (IndexError, KeyError, UnicodeDecodeError):
        return None
    return headers if at == end else None


def _sse_error(name: str, payload: bytes, message: str | None) -> bytes:
    """An exception frame as Anthropic's error event: throttling is a rate limit, a model stream
    error an overload, and so on."""
    try:
        message = str(orjson.loads(payload).get("message") or message or name)
    except (orjson.JSONDecodeError, AttributeError):
        message = message or name or "upstream error"
    _, kind = ERRORS.get(name[:1].upper() + name[1:], (500, "api_error"))
    event = {"type": "error", "error": {"type": kind, "message": message}}
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
