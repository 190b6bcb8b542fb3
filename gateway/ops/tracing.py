"""OpenTelemetry traces, optional (the `otel` extra, `[tracing] endpoint`): a
SERVER span for each API request and a CLIENT span `chat {model}` for each upstream attempt, with
the GenAI semantic conventions' attributes, sent over OTLP/HTTP. The upstream gets `traceparent`.

No prompt or completion text goes into any span: only names, counts, ids and outcomes.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from gateway.config import Deployment, TracingConfig
from middlewares.core.context import ANSWERED_MODEL, LEDGER_ROW, MODEL
from middlewares.core.records import LedgerRow
from middlewares.core.reply import EventStreamReply, MessageReply
from middlewares.core.usage import Usage

# A deployment's provider (Deployment.provider) as OpenTelemetry's GenAI conventions name it.
GENAI_PROVIDERS = {"anthropic": "anthropic", "bedrock": "aws.bedrock", "vertex": "gcp.vertex_ai"}
_OPERATION = {
    "chat_completions": "chat",
    "responses": "chat",
    "messages": "chat",
    "count_tokens": "count_tokens",
    "models": "models",
    "stored_responses": "stored_responses",
}
_DEFAULT_PORTS = {"http": 80, "https": 443}


class TracingUnavailable(Exception):
    """[tracing] is set, but OpenTelemetry's SDK is not installed."""


class Tracing:
    def __init__(self, provider: Any) -> None:
        from opentelemetry import propagate, trace

        self._trace, self._propagate = trace, propagate
        self._tracer = provider.get_tracer("ezat-gateway")
        self.provider = provider

    @staticmethod
    def require_sdk(config: TracingConfig) -> None:
        """Raise TracingUnavailable if [tracing] is set and OpenTelemetry's SDK is not installed."""
        if not config.endpoint:
            return
        try:
            found = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
        except ModuleNotFoundError:  # not even its parent package
            found = False
        if not found:
            raise TracingUnavailable(
                "[tracing] endpoint needs OpenTelemetry's SDK and OTLP exporter (the otel extra): "
                "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
            )

    @classmethod
    def from_config(cls, config: TracingConfig) -> Tracing | None:
        if not config.endpoint:
            return None
        cls.require_sdk(config)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint + "/v1/traces")))
        return cls(provider)

    async def lifespan(self, app: web.Application):
        """aiohttp cleanup context: what is still buffered is sent before the app goes (from a
        thread: the export is a blocking HTTP request)."""
        yield
        await asyncio.to_thread(self.provider.shutdown)

    # --- a request: its SERVER span

    def server_span(self, request: web.Request, route: str, pattern: str) -> Any:
        """`pattern`: the route's (`/v1/models/{model}`), never a path, which holds what a client typed."""
        return self._tracer.start_span(
            f"{request.method} {pattern}",
            kind=self._trace.SpanKind.SERVER,
            context=self._propagate.extract(request.headers),
            attributes={
                "http.request.method": request.method,
                "http.route": pattern,
                "gen_ai.operation.name": _OPERATION.get(route, route),  # a route of no GenAI operation: its own name
            },
        )

    def current(self, span: Any):
        """A context in which `span` is the current one (the upstream attempts' parent)."""
        # (A refusal is no error of the span's: end_server_span says what failed, in its words.)
        return self._trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)

    def end_server_span(
        self, span: Any, request: web.Request, status: int, outcome: str, reply: Any, provider: str | None
    ) -> None:
        """`provider`: the answering deployment's (None: none answered), known only now: a
        request's attempts may go to several providers, and its SERVER span names the one that
        answered (each CLIENT span names its own)."""
        model, answered, row = request.get(MODEL), request.get(ANSWERED_MODEL), request.get(LEDGER_ROW)
        span.set_attribute("http.response.status_code", status)
        if provider is not None:
            span.set_attribute("gen_ai.provider.name", GENAI_PROVIDERS[provider])
        if model is not None:
            span.set_attribute("gen_ai.request.model", model.id)
        if answered is not None:
            span.set_attribute("gen_ai.response.model", answered.id)
        _message(span, reply)
        if row is not None:
            _usage(span, row)
        if outcome != "ok":
            span.set_attribute("error.type", outcome if status < 400 or outcome == "client_closed" else str(status))
            if status >= 500 or outcome == "failed":
                span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        span.end()

    # --- an upstream attempt: its CLIENT span

    @contextmanager
    def attempt(self, operation: str, model: str, deployment: Deployment, headers: dict[str, str]) -> Iterator[Any]:
        """A CLIENT span `{operation} {model}`, current around one attempt; `headers` gains its
        `traceparent`. An attempt that raises ends it here; one that answers hands it to
        `answered`, which ends it with the answer (a stream's when the stream ends)."""
        host, port = _server(deployment.base_url)
        span = self._tracer.start_span(
            f"{operation} {model}",
            kind=self._trace.SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": GENAI_PROVIDERS[deployment.provider],
                "gen_ai.request.model": model,
                "server.address": host,
                "server.port": port,
            },
        )
        try:
            with self.current(span):
                self._propagate.inject(headers)
                yield span
        except BaseException:
            span.end()
            raise

    def failed(self, span: Any, outcome: str) -> None:
        """An attempt that failed, as ezat_upstream_attempts_total counts it (`outcome`)."""
        span.set_attribute("error.type", outcome)
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))

    @staticmethod
    def answered(span: Any, reply: Any) -> None:
        """An attempt's answer: the upstream message's id, stop reason, model (the upstream's
        own name, which may differ from the name asked: the SERVER span names the configured
        model) and usage, as the GenAI conventions put them on the inference span. A stream's
        span ends when the stream does: its stop reason and usage are known only then."""
        if isinstance(reply, EventStreamReply):
            reply.when_done(lambda stream: _ended(span, stream, stream.usage.total()))
        else:
            _ended(span, reply, reply.usage if isinstance(reply, MessageReply) else None)


def _ended(span: Any, reply: Any, usage: Usage | None) -> None:
    _message(span, reply)
    if isinstance(reply, (MessageReply, EventStreamReply)) and reply.response_model:
        span.set_attribute("gen_ai.response.model", reply.response_model)
    if usage is not None:
        _usage(span, usage)
    span.end()


def _usage(span: Any, usage: Usage | LedgerRow) -> None:
    """Token counts as the GenAI conventions name them: the input counts every input token,
    cache reads and writes included, which have their own attributes too."""
    span.set_attribute(
        "gen_ai.usage.input_tokens", usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
    )
    span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
    span.set_attribute("gen_ai.usage.cache_read.input_tokens", usage.cache_read_tokens)
    span.set_attribute("gen_ai.usage.cache_creation.input_tokens", usage.cache_write_tokens)


def _message(span: Any, reply: Any) -> None:
    """The upstream message's id and stop reason, as far as the reply knows them yet."""
    if isinstance(reply, (MessageReply, EventStreamReply)):
        if reply.message_id:
            span.set_attribute("gen_ai.response.id", reply.message_id)
        if reply.stop_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [reply.stop_reason])


@lru_cache(maxsize=256)
def _server(base_url: str) -> tuple[str, int]:
    """A deployment's host and port, the scheme's when the URL names none (the config allows only
    http(s) URLs with a host)."""
    parts = urlsplit(base_url)
    return parts.hostname or "", parts.port or _DEFAULT_PORTS.get(parts.scheme, 0)
