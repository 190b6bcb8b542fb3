"""The mock upstream as Amazon Bedrock's runtime serves Claude: InvokeModel, its response stream
and CountTokens, behind SigV4 or a Bedrock API key.

A thin layer over `MockUpstream`: the same scenarios, checks, prompt cache and events, with
Bedrock's body (no `model`, `anthropic_version` and `anthropic_beta` inside it), its error
envelope and its event-stream framing. A signature is verified as AWS does: recomputed with
botocore from the request as received, with the secret of the access key it names.
"""

from __future__ import annotations

import base64
import calendar
import hashlib
import hmac
import re
import secrets
import string
import struct
import time
import uuid
import zlib
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass

import orjson
from aiohttp import web
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from gateway import runtime
from gateway.mock.cache import prompt_tokens
from gateway.mock.upstream import ANTHROPIC_VERSIONS, Credential, MockUpstream, RecordedRequest, Scenario
from gateway.mock.validation import ALLOWED_FIELDS, Invalid, validate

# The SDK's Bedrock client sends its own API version (2026-10-21) where the documented
# "bedrock-2023-05-31" is not given.
BEDROCK_VERSIONS = frozenset({"bedrock-2023-05-31"}) | ANTHROPIC_VERSIONS
# The beta flags Bedrock knows; any other is refused ("invalid beta flag"), unlike Anthropic's
# API, which ignores a well-formed name it does not know.
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
# A status's exception name (x-amzn-ErrorType); a scenario's status is answered as given.
ERROR_NAMES = {
    400: "ValidationException",
    403: "AccessDeniedException",
    404: "ResourceNotFoundException",
    408: "ModelTimeoutException",
    424: "ModelErrorException",
    429: "ThrottlingException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
}
_BEDROCK_NAMESPACE = "http://internal.amazon.com/coral/com.amazon.bedrock/"
_AUTH_NAMESPACE = "http://internal.amazon.com/coral/com.amazon.coral.service/"
# A scenario's stream error type (Anthropic's) as the exception frame Bedrock sends instead.
STREAM_EXCEPTIONS = {
    "overloaded_error": "modelStreamErrorException",
    "rate_limit_error": "throttlingException",
    "invalid_request_error": "validationException",
    "timeout_error": "modelTimeoutException",
    "api_error": "internalServerException",
}
# CountTokens' answer for a model it cannot count (not every Claude model on Bedrock has it).
COUNT_UNSUPPORTED = "The provided model doesn't support counting tokens."
SERVICE = "bedrock"
MAX_CLOCK_SKEW = 300  # seconds an X-Amz-Date may be off, as AWS allows
_AUTHORIZATION = re.compile(
    r"AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/(?P<service>[^/]+)/aws4_request,"
    r"\s*SignedHeaders=(?P<signed>[a-z0-9;-]+),\s*Signature=(?P<signature>[0-9a-f]{64})"
)


@dataclass(frozen=True)
class AwsKey:
    """An access key the mock accepts; temporary credentials (STS) come with a session token."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


def _random(prefix: str, length: int, alphabet: str = string.ascii_uppercase + string.digits) -> str:
    return prefix + "".join(secrets.choice(alphabet) for _ in range(length - len(prefix)))


def generate_keys() -> tuple[AwsKey, AwsKey]:
    """A long-term access key (AKIA…) and temporary credentials (ASIA…, with a session token)."""
    secret_alphabet = string.ascii_letters + string.digits + "+/"
    return (
        AwsKey(_random("AKIAMOCK", 20), _random("", 40, secret_alphabet)),
        AwsKey(_random("ASIAMOCK", 20), _random("", 40, secret_alphabet), _random("IQoJmock", 356, secret_alphabet)),
    )


def event_frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One message of the application/vnd.amazon.eventstream encoding, every header a string
    (type 7): prelude (total and headers' lengths, their CRC32), headers, payload, CRC32 of all.
    botocore only decodes the format, and AWS's encoder for Python (smithy-aws-event-stream)
    needs Python 3.12; the tests decode every frame with botocore's EventStreamBuffer."""
    encoded = b"".join(
        struct.pack("!B", len(name)) + name + struct.pack("!BH", 7, len(value)) + value
        for name, value in ((n.encode(), v.encode()) for n, v in headers.items())
    )
    prelude = struct.pack("!II", 12 + len(encoded) + len(payload) + 4, len(encoded))
    message = prelude + struct.pack("!I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack("!I", zlib.crc32(message))


# When this request began, and when its first frame went: a stream's invocation metrics.
_TIMES: ContextVar[dict[str, float]] = ContextVar("bedrock_times")


class BedrockRefusal(Exception):
    """A request Bedrock refuses: its status, exception name and message."""

    def __init__(self, status: int, name: str, message: str, namespace: str = _BEDROCK_NAMESPACE):
        super().__init__(message)
        self.status, self.name, self.namespace = status, name, namespace


def _signature_refusal(message: str) -> BedrockRefusal:
    return BedrockRefusal(403, "InvalidSignatureException", message, _AUTH_NAMESPACE)


def verify_sigv4(request: web.Request, body: bytes, keys: dict[str, AwsKey], region: str) -> Credential:
    """The credential a SigV4-signed request was signed with, or the refusal AWS would answer.
    The signature is recomputed by botocore's SigV4Auth over the request as received (method,
    URL, the headers it names as signed, the body) and compared in constant time."""
    header = request.headers.get("Authorization", "")
    auth = _AUTHORIZATION.fullmatch(header)
    if auth is None:
        raise BedrockRefusal(403, "IncompleteSignatureException", f"Authorization header is malformed: {header!r}")
    key = keys.get(auth["key"])
    if key is None:
        raise BedrockRefusal(
            403,
            "UnrecognizedClientException",
            "The security token included in the request is invalid.",
            _AUTH_NAMESPACE,
        )
    signed = auth["signed"].split(";")
    for required in ("host", "x-amz-date"):
        if required not in signed:
            raise _signature_refusal(f"'{required}' must be a 'SignedHeader' in the AWS Authorization.")
    missing = [name for name in signed if name not in request.headers]
    if missing:
        raise _signature_refusal(f"Signed header(s) not in the request: {', '.join(missing)}")
    amz_date = request.headers["X-Amz-Date"]
    try:
        signed_at = calendar.timegm(time.strptime(amz_date, "%Y%m%dT%H%M%SZ"))
    except ValueError:
        raise _signature_refusal(f"Invalid X-Amz-Date: {amz_date!r}") from None
    skew = time.time() - signed_at
    if abs(skew) > MAX_CLOCK_SKEW:
        raise _signature_refusal(f"Signature expired: {amz_date} is {abs(skew):.0f} s off the server's clock (5 min.)")
    if auth["date"] != amz_date[:8] or auth["region"] != region or auth["service"] != SERVICE:
        raise _signature_refusal(f"Credential should be scoped to {amz_date[:8]}/{region}/{SERVICE}/aws4_request.")
    sent_token = request.headers.get("X-Amz-Security-Token")
    if sent_token != key.session_token:
        raise BedrockRefusal(
            403,
            "UnrecognizedClientException",
            "The security token included in the request is invalid.",
            _AUTH_NAMESPACE,
        )
    content_hash = request.headers.get("X-Amz-Content-SHA256")
    if "x-amz-content-sha256" in signed and content_hash != hashlib.sha256(body).hexdigest():
        raise _signature_refusal("The provided 'x-amz-content-sha256' header does not match what was computed.")

    url = f"{request.scheme}://{request.host}{request.raw_path}"
    rebuilt = AWSRequest(
        method=request.method,
        url=url,
        headers={name: ",".join(request.headers.getall(name)) for name in signed},
        data=body,
    )
    rebuilt.context["timestamp"] = amz_date
    signer = SigV4Auth(Credentials(key.access_key_id, key.secret_access_key, key.session_token), SERVICE, region)
    expected = signer.signature(signer.string_to_sign(rebuilt, signer.canonical_request(rebuilt)), rebuilt)
    if not hmac.compare_digest(expected, auth["signature"]):
        raise _signature_refusal(
            "The request signature we calculated does not match the signature you provided. "
            "Check your AWS Secret Access Key and signing method."
        )
    return Credential(
        "sigv4", key.access_key_id, session_token=sent_token, session_token_signed="x-amz-security-token" in signed
    )


class BedrockMock(MockUpstream):
    """Bedrock's runtime API for Claude on loopback. Without `keys` it makes a long-term key
    (`key`) and temporary credentials (`temporary_key`); without `api_keys`, one Bedrock API key
    (`api_key_bearer`). Each request's `auth` records which one it was signed or sent with.
    With `counts_tokens` False, CountTokens answers as Bedrock does for a model it cannot count."""

    REQUEST_ID_HEADER = "x-amzn-RequestId"
    # fast=True, the benchmarks' Bedrock: no authentication, no validation, no recording; the
    # reply chosen by the path's model id without its provider and region prefixes
    # ("anthropic.bench-stream50" is bench-stream50), a stream's frames encoded once.
    FAST_STREAM_HEADERS = {
        "content-type": "application/vnd.amazon.eventstream",
        "x-amzn-bedrock-content-type": "application/json",
    }

    def __init__(
        self,
        *,
        region: str = "us-east-1",
        keys: Iterable[AwsKey] | None = None,
        api_keys: Iterable[str] | None = None,
        betas: frozenset[str] = BEDROCK_BETAS,
        fast: bool = False,
    ):
        self.region = region
        self.key, self.temporary_key = generate_keys()
        self.keys = {k.access_key_id: k for k in (keys if keys is not None else (self.key, self.temporary_key))}
        self.api_key_bearer = "ABSKmock" + secrets.token_urlsafe(32)
        self.api_keys = frozenset(api_keys if api_keys is not None else (self.api_key_bearer,))
        self.betas = betas
        self.counts_tokens = True
        super().__init__(fast=fast)

    def _add_routes(self, router: web.UrlDispatcher, fast: bool) -> None:
        invoke = self._fast if fast else self._invoke
        router.add_post("/model/{model_id}/invoke", invoke)
        router.add_post("/model/{model_id}/invoke-with-response-stream", invoke)
        if not fast:
            router.add_post("/model/{model_id}/count-tokens", self._count)

    async def _fast_model(self, request: web.Request) -> str | None:
        await request.read()
        return request.match_info["model_id"].rpartition(".")[2]

    # -- the requests -----------------------------------------------------------------------

    async def _invoke(self, request: web.Request) -> web.StreamResponse:
        _TIMES.set({"start": time.monotonic()})
        recorded, body = await self._record(request)
        try:
            self._authenticate(request, recorded)
            anthropic = self._anthropic_body(body, request.match_info["model_id"])
        except BedrockRefusal as refusal:
            return self._refuse(refusal)
        stream = request.path.endswith("/invoke-with-response-stream")
        return await self._answer(request, anthropic, stream=stream)

    async def _count(self, request: web.Request) -> web.Response:
        """CountTokens: the InvokeModel body, base64 (a blob, in AWS's JSON), in
        {"input": {"invokeModel": {"body"}}}."""
        recorded, body = await self._record(request)
        try:
            self._authenticate(request, recorded)
            invoke = body.get("input", {}).get("invokeModel") if isinstance(body, dict) else None
            if not isinstance(invoke, dict) or not isinstance(invoke.get("body"), str):
                raise BedrockRefusal(400, "ValidationException", "input.invokeModel.body: a blob is required")
            try:
                inner = orjson.loads(base64.b64decode(invoke["body"], validate=True))
            except (ValueError, orjson.JSONDecodeError):  # binascii.Error is a ValueError
                raise BedrockRefusal(400, "ValidationException", "Malformed input request") from None
            anthropic = self._anthropic_body(inner, request.match_info["model_id"])
        except BedrockRefusal as refusal:
            return self._refuse(refusal)
        if not self.counts_tokens:
            return self._aws_error(400, "ValidationException", COUNT_UNSUPPORTED, _BEDROCK_NAMESPACE)
        if self.count_tokens_status != 200:
            return self._error(self.count_tokens_status, "mock error")
        return web.json_response(
            {"inputTokens": prompt_tokens(anthropic)}, headers={self.REQUEST_ID_HEADER: str(uuid.uuid4())}
        )

    def _authenticate(self, request: web.Request, recorded: RecordedRequest) -> None:
        authorization = request.headers.get("Authorization", "")
        if authorization.startswith("Bearer "):
            bearer = authorization.removeprefix("Bearer ")
            if bearer not in self.api_keys:
                raise BedrockRefusal(403, "AccessDeniedException", "Invalid API Key format or unknown API key.")
            recorded.auth = Credential("bearer", bearer)
        elif not authorization:
            raise BedrockRefusal(
                403, "MissingAuthenticationTokenException", "Missing Authentication Token", _AUTH_NAMESPACE
            )
        else:
            recorded.auth = verify_sigv4(request, recorded.raw, self.keys, self.region)

    def _anthropic_body(self, body: object, model: str) -> dict:
        """Bedrock's body as the Messages API's (its betas taken out, `model` put in), checked."""
        if not isinstance(body, dict):
            raise BedrockRefusal(400, "ValidationException", "Malformed input request, please reformat your input.")
        version = body.get("anthropic_version")
        if version is None:
            raise BedrockRefusal(400, "ValidationException", "#: required key [anthropic_version] not found")
        if version not in BEDROCK_VERSIONS:
            raise BedrockRefusal(400, "ValidationException", f"Invalid API version: {version!r}")
        for extraneous in ("model", "stream"):
            if extraneous in body:
                raise BedrockRefusal(400, "ValidationException", f"#: extraneous key [{extraneous}] is not permitted")
        betas = body.get("anthropic_beta", [])
        if not isinstance(betas, list) or not all(isinstance(beta, str) for beta in betas):
            raise BedrockRefusal(400, "ValidationException", "anthropic_beta: a list of strings is required")
        unknown = [beta for beta in betas if beta not in self.betas]
        if unknown:
            raise BedrockRefusal(400, "ValidationException", f"invalid beta flag: {', '.join(unknown)}")
        anthropic = {k: v for k, v in body.items() if k not in ("anthropic_version", "anthropic_beta")}
        anthropic["model"] = model
        try:
            validate(anthropic, ALLOWED_FIELDS, frozenset(betas))
        except Invalid as exc:
            raise BedrockRefusal(400, "ValidationException", str(exc)) from None
        return anthropic

    # -- the replies --------------------------------------------------------------------------

    def _refuse(self, refusal: BedrockRefusal) -> web.Response:
        return self._aws_error(refusal.status, refusal.name, str(refusal), refusal.namespace)

    def _aws_error(
        self, status: int, name: str, message: str, namespace: str, headers: dict | None = None
    ) -> web.Response:
        return web.Response(
            status=status,
            body=orjson.dumps({"message": message}),
            content_type="application/json",
            headers={
                **(headers or {}),
                "x-amzn-ErrorType": f"{name}:{namespace}",
                self.REQUEST_ID_HEADER: str(uuid.uuid4()),
            },
        )

    def _error(self, status: int, message: str, headers: dict | None = None) -> web.Response:
        name = ERROR_NAMES.get(status, "InternalServerException")
        return self._aws_error(status, name, message, _BEDROCK_NAMESPACE, headers)

    def _message_headers(self, message: dict) -> dict[str, str]:
        usage = message["usage"]
        return {
            self.REQUEST_ID_HEADER: str(uuid.uuid4()),
            "x-amzn-bedrock-input-token-count": str(usage["input_tokens"]),
            "x-amzn-bedrock-output-token-count": str(usage["output_tokens"]),
            "x-amzn-bedrock-cache-read-input-token-count": str(usage["cache_read_input_tokens"]),
            "x-amzn-bedrock-cache-write-input-token-count": str(usage["cache_creation_input_tokens"]),
            "x-amzn-bedrock-invocation-latency": str(self._elapsed_ms()),
        }

    def _stream_headers(self) -> dict[str, str]:
        return {
            "content-type": "application/vnd.amazon.eventstream",
            "x-amzn-bedrock-content-type": "application/json",
            self.REQUEST_ID_HEADER: str(uuid.uuid4()),
        }

    def _frame(self, event: dict, message: dict) -> bytes:
        """A `chunk` event whose payload is the Anthropic event's JSON, base64-encoded, and padding; the last
        (message_stop) adds the invocation's metrics, as Bedrock does."""
        times = _TIMES.get({})
        times.setdefault("first_byte", time.monotonic())
        if event["type"] == "message_stop":
            usage = message["usage"]
            event = event | {
                "amazon-bedrock-invocationMetrics": {
                    "inputTokenCount": usage["input_tokens"],
                    "outputTokenCount": usage["output_tokens"],
                    "invocationLatency": self._elapsed_ms(),
                    "firstByteLatency": round((times["first_byte"] - times.get("start", times["first_byte"])) * 1000),
                    "cacheReadInputTokenCount": usage["cache_read_input_tokens"],
                    "cacheWriteInputTokenCount": usage["cache_creation_input_tokens"],
                }
            }
        # "p": the padding Bedrock adds so that a frame's length does not give its event's away.
        padding = "".join(secrets.choice(string.ascii_letters) for _ in range(secrets.randbelow(40) + 1))
        payload = orjson.dumps({"bytes": base64.b64encode(orjson.dumps(event)).decode(), "p": padding})
        headers = {":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"}
        return event_frame(headers, payload)

    def _stream_error(self, sc: Scenario, request_id: str) -> bytes:
        """An `exception` frame; the stream ends after it."""
        name = STREAM_EXCEPTIONS.get(sc.stream_error_type, "internalServerException")
        error: dict[str, object] = {"message": sc.stream_error_message}
        if name == "modelStreamErrorException":
            error |= {"originalStatusCode": 529, "originalMessage": sc.stream_error_message}
        headers = {":exception-type": name, ":content-type": "application/json", ":message-type": "exception"}
        return event_frame(headers, orjson.dumps(error))

    @staticmethod
    def _elapsed_ms() -> int:
        start = _TIMES.get({}).get("start")
        return 0 if start is None else round((time.monotonic() - start) * 1000)

    def describe(self) -> str:
        """What a client needs to call this mock, one setting a line."""
        return "\n".join(
            (
                f"  region: {self.region} (service {SERVICE})",
                f"  access key: {self.key.access_key_id} secret: {self.key.secret_access_key}",
                f"  temporary access key: {self.temporary_key.access_key_id} "
                f"secret: {self.temporary_key.secret_access_key} session token: {self.temporary_key.session_token}",
                f"  Bedrock API key (Authorization: Bearer): {self.api_key_bearer}",
            )
        )


def run(host: str, port: int, *, region: str = "us-east-1", fast: bool = False) -> None:
    """Serve the Bedrock mock until Ctrl-C or SIGTERM (`ezat-gateway mock-upstream --provider
    bedrock`; with fast=True, the benchmarks' Bedrock, bench/mock.py --provider bedrock)."""

    async def serve() -> None:
        mock = BedrockMock(region=region, fast=fast)
        url = await mock.start(host, port)
        runtime.tune_garbage_collector()  # as the gateway's, so a benchmark's processes all run alike
        print(f"Mock Amazon Bedrock runtime listening on {url} (POST /model/{{modelId}}/invoke, ", end="")
        print("/invoke-with-response-stream, /count-tokens); it accepts:", flush=True)
        print(mock.describe(), flush=True)
        await runtime.until_stopped()
        await mock.close()

    runtime.run(serve())
