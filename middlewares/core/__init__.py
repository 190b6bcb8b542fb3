"""The core every stage depends on, and nothing else: the request keys, the error type and its
OpenAI envelope, the unsent reply types, usage and its price, the records a stage reads and
writes, and the Protocols for what a stage is handed. It imports only aiohttp, orjson and the
standard library, so another aiohttp app can mount a stage without the gateway's application,
config, storage or ledger."""

from middlewares.core.chain import ChainError, Endpoint, Keys, Stage, checked, stage
from middlewares.core.context import (
    ANSWERED_MODEL,
    API_KEY,
    BODY,
    BODY_BYTES,
    CLIENT_BYTES,
    DEPLOYMENT,
    FALLBACK_MODELS,
    MODEL,
    REQUEST_ID,
    SESSION,
    SETTLE,
    body_changed,
    client_bytes,
    request_id,
)
from middlewares.core.errors import GatewayError, anthropic_error_envelope, error_envelope, invalid_request
from middlewares.core.protocols import (
    FindKey,
    FindModel,
    ModelSpec,
    PricedPerDeployment,
    Pricing,
    RateLimiter,
    RecordRow,
    Spending,
)
from middlewares.core.records import KeyRecord, LedgerRow, Shortfall
from middlewares.core.reply import EventStreamReply, MessageReply
from middlewares.core.usage import StreamUsage, Usage

__all__ = [
    "ANSWERED_MODEL",
    "API_KEY",
    "BODY",
    "BODY_BYTES",
    "CLIENT_BYTES",
    "DEPLOYMENT",
    "FALLBACK_MODELS",
    "MODEL",
    "REQUEST_ID",
    "SESSION",
    "SETTLE",
    "ChainError",
    "Endpoint",
    "EventStreamReply",
    "FindKey",
    "FindModel",
    "GatewayError",
    "KeyRecord",
    "Keys",
    "LedgerRow",
    "MessageReply",
    "ModelSpec",
    "PricedPerDeployment",
    "Pricing",
    "RateLimiter",
    "RecordRow",
    "Shortfall",
    "Spending",
    "Stage",
    "StreamUsage",
    "Usage",
    "checked",
    "anthropic_error_envelope",
    "body_changed",
    "client_bytes",
    "error_envelope",
    "invalid_request",
    "request_id",
    "stage",
]
