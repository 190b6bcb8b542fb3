"""The proxy handler: sends the (already Anthropic-shaped) request to a deployment and returns
the reply unsent, for the stages to translate and bill on the way out; and the count_tokens
handler, which forwards a request to a deployment's own count and answers as it answers.

Nothing reaches the client before the upstream has produced output, so a failed attempt is
invisible: deployments are tried in routing order (skipping cooled-down ones), then the
request's fallback models, until one answers or the attempts run out. A connection failure, a
timeout before the first token, 429 or a 5xx moves on; a request the upstream refuses as
invalid (other 4xx) is answered at once.

On the routes that speak Anthropic's API (`native`), the client's `anthropic-version` and
`anthropic-beta` headers and its `beta` query go upstream as it sent them, and so does its body,
byte for byte, when nothing changed it: no stage (`client_bytes`), and not the model's own
terms (`_for_model`: its upstream id is the name asked by, nothing clamped or left out). That is
on Anthropic's API: a cloud's provider writes the request its own way (upstream/bedrock.py,
upstream/vertex.py), its betas filtered.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import aiohttp
import orjson
from aiohttp import web

from gateway.config import Config, Deployment, Model
from gateway.ops.metrics import NO_METRICS, Metrics, NoMetrics
from gateway.ops.tracing import Tracing
from gateway.upstream.client import UpstreamClient, UpstreamEvents, UpstreamUnreachable
from gateway.upstream.errors import retry_after_seconds
from gateway.upstream.health import Health
from gateway.upstream.provider import COUNT_TOKENS, MESSAGES, ClientBytes, CountUnsupported, UpstreamBody, parsed
from gateway.upstream.routing import affinity, ranked
from gateway.upstream.shape import readable_message
from gateway.upstream.streams import OpenStreams
from middlewares.core.chain import Endpoint, Keys
from middlewares.core.context import (
    ANSWERED_MODEL,
    BODY,
    CLIENT_BYTES,
    DEPLOYMENT,
    FALLBACK_MODELS,
    MODEL,
    SESSION,
    client_bytes,
)
from middlewares.core.errors import GatewayError, retry_after
from middlewares.core.reply import EventStreamReply, MessageReply
from middlewares.core.sizes import MiB
from middlewares.core.usage import estimate_tokens

log = logging.getLogger("ezat.upstream")

# docs/api.md, "Errors": a non-streaming request that takes longer than this ends with 504.
NON_STREAMING_DEADLINE = 590.0
# Failures another deployment may not have (an upstream 401 is the gateway's credential: 500).
RETRYABLE = frozenset({429, 500, 502, 503, 504})


class FirstTokenTimeout(GatewayError):
    """A stream's deployment produced nothing in time. A 500, not the 504 `timeout`: that one
    tells a non-streaming request to stream."""

    def __init__(self, seconds: float) -> None:
        super().__init__(500, f"The upstream produced nothing within {seconds:g} seconds.", type="server_error")


def attempt_outcome(failure: GatewayError) -> str:
    """What came of a failed attempt, as ezat_upstream_attempts_total counts it."""
    if isinstance(failure, UpstreamUnreachable):
        return "connect_error"
    if isinstance(failure, FirstTokenTimeout):
        return "timeout"
    status = failure.anthropic_status_and_type()[0]  # the upstream's own: 529 stays 529
    return str(status) if status in (429, 529) else "5xx" if status >= 500 else "4xx"


def proxy_handler(
    config: Config,
    upstream: UpstreamClient,
    *,
    attempts: Attempts | None = None,
    non_streaming_deadline: float = NON_STREAMING_DEADLINE,
    streams: OpenStreams | None = None,
    native: bool = False,
    check_client_bytes: bool = False,
) -> Endpoint:
    attempts = attempts or Attempts(config)
    metrics = attempts.metrics

    async def stream(deployment: Deployment, body: UpstreamBody, forward: Forward) -> EventStreamReply:
        try:
            async with asyncio.timeout(deployment.first_token_timeout_seconds):
                events = UpstreamEvents(
                    await upstream.post(deployment, body, **forward),
                    idle_timeout=deployment.stream_idle_timeout_seconds,
                    max_duration=deployment.max_stream_duration_seconds,
                    relay=native,  # the native route sends on the upstream's bytes
                    decode=upstream.provider(deployment).decoder(),
                )
                await events.first_output()
        except TimeoutError:
            raise FirstTokenTimeout(deployment.first_token_timeout_seconds) from None
        return EventStreamReply(events, streams=streams)

    async def message(deployment: Deployment, body: UpstreamBody, forward: Forward) -> MessageReply:
        _, message = await _json_answer(upstream, deployment, body, **forward)
        if not readable_message(message):
            raise GatewayError(500, "The upstream sent a reply the gateway cannot read.", type="server_error")
        return MessageReply(message)

    async def first_answer(request: web.Request, deadline: float | None) -> web.StreamResponse:
        body = request[BODY]
        asked = cast(Model, request[MODEL])  # the limits stage found it with config.model
        models = [asked, *request.get(FALLBACK_MODELS, ())]
        # Worked out only when there is a deployment to choose (the digest costs a serialisation).
        choosing = any(len(model.deployments) > 1 for model in models)
        stick_by = affinity(request.get(SESSION), body) if choosing else None
        sent = client_bytes(request, check=check_client_bytes) if native else None
        tries = ((model, _upstream_body(body, model, asked, sent)) for model in models)
        reply, name, model = await attempts.first(
            tries, stream if body.get("stream") else message, stick_by, _forwarded(request) if native else {}, deadline
        )
        request[DEPLOYMENT], request[ANSWERED_MODEL] = name, model
        # The prompt is not held while its answer streams: it may be megabytes (images
        # included), and a stream may run for minutes. Nor are its bytes.
        del request[BODY]
        request.pop(CLIENT_BYTES, None)
        reply.headers["x-ezat-model"] = model.id
        if model is not asked:
            reply.headers["x-ezat-routed-from"] = asked.id
            metrics.fallback(asked.id, model.id)
        return reply

    async def proxy(request: web.Request) -> web.StreamResponse:
        """Requires `request[BODY]`, an Anthropic Messages request, and `request[MODEL]`; takes
        `request[BODY]` away once an answer has begun."""
        if request[BODY].get("stream"):
            return await first_answer(request, None)
        try:
            return await first_answer(request, asyncio.get_running_loop().time() + non_streaming_deadline)
        except TimeoutError:
            raise GatewayError(
                504,
                f"The request took longer than {non_streaming_deadline:g} seconds; stream it instead.",
                type="server_error",
                code="timeout",
            ) from None

    keys = Keys(
        "proxy",
        requires=frozenset({BODY, MODEL}),
        provides=frozenset({ANSWERED_MODEL, DEPLOYMENT}),
        reads=frozenset({FALLBACK_MODELS, SESSION, CLIENT_BYTES}),
    )
    return Endpoint(keys, proxy)


def count_tokens_handler(
    upstream: UpstreamClient,
    *,
    attempts: Attempts,
    deadline: float = NON_STREAMING_DEADLINE,
    check_client_bytes: bool = False,
) -> Endpoint:
    """Answers Anthropic's `count_tokens` with the asked model's count (`request[MODEL]`), from
    the first of its deployments that answers, as it answers: never a count made up here, and
    no fallback model stands in (its count would be another model's). Past `deadline` seconds,
    as a non-streaming request, a 504."""

    async def count(deployment: Deployment, body: UpstreamBody, forward: Forward) -> web.Response:
        try:
            raw, counted = await _json_answer(upstream, deployment, body, path=COUNT_TOKENS, **forward)
        except CountUnsupported:  # the deployment counts no tokens for this model
            estimate = {"input_tokens": estimated_input_tokens(body)}
            return web.json_response(estimate, headers={"x-ezat-input-tokens": "estimated"})
        tokens = counted.get("input_tokens") if isinstance(counted, dict) else None
        if type(tokens) is not int or tokens < 0:
            raise GatewayError(500, "The upstream sent a count the gateway cannot read.", type="server_error")
        return web.Response(body=raw, content_type="application/json")  # as it answered

    async def count_tokens(request: web.Request) -> web.StreamResponse:
        model = cast(Model, request[MODEL])  # the limits stage found it with config.model
        body = _upstream_body(request[BODY], model, model, client_bytes(request, check=check_client_bytes))
        try:
            answer, request[DEPLOYMENT], request[ANSWERED_MODEL] = await attempts.first(
                [(model, body)],
                count,
                None,
                _forwarded(request),
                asyncio.get_running_loop().time() + deadline,
                operation="count_tokens",
            )
        except TimeoutError:
            raise GatewayError(
                504, f"The request took longer than {deadline:g} seconds.", type="server_error", code="timeout"
            ) from None
        return answer

    keys = Keys(
        "count_tokens",
        requires=frozenset({BODY, MODEL}),
        provides=frozenset({ANSWERED_MODEL, DEPLOYMENT}),
        reads=frozenset({CLIENT_BYTES}),
    )
    return Endpoint(keys, count_tokens)


class Attempts:
    """Trying deployments in turn: their health (shared by every route, since the deployments
    are), and what each attempt leaves in the metrics and the trace."""

    def __init__(
        self, config: Config, *, metrics: Metrics | NoMetrics = NO_METRICS, tracing: Tracing | None = None
    ) -> None:
        self.config, self.metrics, self.tracing = config, metrics, tracing
        self.health = Health(
            failures_before_cooldown=config.routing.failures_before_cooldown,
            cooldown=config.routing.cooldown_seconds,
            metrics=metrics,
        )

    async def first(
        self,
        tries,
        attempt,
        stick_by: str | None,
        forward: Forward,
        deadline: float | None = None,
        operation: str = "chat",
    ):
        """The first answer of `attempt` (an `operation`, for the trace) over each (model,
        upstream body: a dict, or the client's bytes) of `tries` in turn and that model's usable
        deployments, within max_attempts: (reply, deployment, model). Past `deadline` (loop
        time), TimeoutError."""
        health, metrics = self.health, self.metrics
        attempts = self.config.routing.max_attempts
        error: GatewayError | None = None
        for model, upstream_body in tries:
            deployments = ranked(model.deployments, stick_by)
            usable = health.available(deployments)
            if not usable:
                error = error or _all_cooling(health.cooling_ends(deployments))
            for name in usable:
                if attempts == 0:
                    assert error is not None  # max_attempts is at least 1: one failed
                    raise error
                attempts -= 1
                deployment = self.config.deployment(name)
                assert deployment is not None  # the config checks that a model's deployments exist
                body = _at_deployment(upstream_body, model, name)
                try:
                    async with asyncio.timeout_at(deadline):
                        reply = await self._try(attempt, model, deployment, body, forward, operation)
                except TimeoutError:
                    metrics.attempt(name, "timeout")
                    raise
                except GatewayError as failure:
                    metrics.attempt(name, attempt_outcome(failure))
                    if failure.status not in RETRYABLE:
                        raise
                    health.failed(name, retry_after_seconds(failure.headers.get("retry-after")))
                    error = failure
                    continue
                health.succeeded(name)
                metrics.attempt(name, "ok")
                return reply, name, model
        assert error is not None  # each model's deployments were cooling, or failed
        raise error

    async def _try(
        self, attempt, model: Model, deployment: Deployment, body: UpstreamBody, forward: Forward, operation: str
    ):
        if self.tracing is None:
            return await attempt(deployment, body, forward)
        context: dict[str, str] = {}  # the trace's, for the upstream
        # The body's `model` is the deployment's id for the model (`_at_deployment`).
        with self.tracing.attempt(operation, model.upstream_model_at(deployment.name), deployment, context) as span:
            try:
                headers = [*forward.get("headers", ()), *context.items()]
                reply = await attempt(deployment, body, {**forward, "headers": headers})
            except GatewayError as failure:
                self.tracing.failed(span, attempt_outcome(failure))  # in the metric's words
                raise
            self.tracing.answered(span, reply)
            return reply


async def _json_answer(
    upstream: UpstreamClient, deployment: Deployment, body: UpstreamBody, *, path: str = MESSAGES, **options
) -> tuple[bytes, Any]:
    """The deployment's whole answer, as Anthropic's API gives it, and it parsed (None when it is
    not JSON, or is larger than any answer: it is not read then)."""
    try:
        async with await upstream.post(deployment, body, path=path, **options) as response:
            raw = await _whole_body(response)
    except (aiohttp.ClientError, OSError):
        raise UpstreamUnreachable("The upstream connection broke.") from None
    if raw is None:
        return b"", None
    raw = upstream.provider(deployment).answer(path, raw, response.headers)
    try:
        return raw, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw, None


# More than any message or count takes (a message's output is at most its max_tokens).
MAX_ANSWER_BYTES = 32 * MiB


async def _whole_body(response: aiohttp.ClientResponse) -> bytes | None:
    """The body, or None past MAX_ANSWER_BYTES (the connection is then closed, not read on)."""
    length = response.content_length
    if length is None:  # chunked: read as far as the cap
        chunks, size = [], 0
        async for chunk in response.content.iter_any():
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                break
            chunks.append(chunk)
        else:
            return b"".join(chunks)
    elif length <= MAX_ANSWER_BYTES:
        return await response.read()
    log.warning("upstream answer over %d bytes, not read", MAX_ANSWER_BYTES)
    response.close()
    return None


# What a client of Anthropic's API sends that goes upstream with its request, as sent.
FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta")
Forward = dict[str, Any]  # upstream.post's `headers` (lines) and `query`


def _forwarded(request: web.Request) -> Forward:
    # Every line of them, byte for byte: a header sent on several lines goes on several.
    headers = [(name, value) for name in FORWARDED_HEADERS for value in request.headers.getall(name, ())]
    beta = request.query.get("beta")
    return {"headers": headers, "query": {"beta": beta} if beta is not None else {}}


def _upstream_body(body: dict[str, Any], model: Model, asked: Model, sent: bytes | None) -> UpstreamBody:
    """The upstream request for `model`: `sent`, the client's bytes of `body` (None when a stage
    changed it), when `_for_model` leaves it as it is, else the request to encode. The
    comparison costs a look at each top-level field: `_for_model` makes a shallow copy, so every
    field it leaves is the same object, compared by identity."""
    upstream_body = _for_model(body, model, asked)
    return ClientBytes(sent, body) if sent is not None and upstream_body == body else upstream_body


def _at_deployment(body: UpstreamBody, model: Model, deployment: str) -> UpstreamBody:
    """`body` naming the model as `deployment` knows it (a Bedrock profile, a Vertex version)."""
    named = model.upstream_models.get(deployment)
    if named is None:
        return body
    return {**parsed(body), "model": named}


def estimated_input_tokens(body: UpstreamBody) -> int:
    """A request's input tokens, where no upstream counts them: its text's characters, about 4 a
    token (JSON's syntax counted too, so an overestimate)."""
    request = parsed(body)
    return estimate_tokens(len(orjson.dumps([request.get(k) for k in ("system", "messages", "tools")])))


def _for_model(body: dict[str, Any], model: Model, asked: Model) -> dict[str, Any]:
    """The upstream request for `model`: a fallback gets what it supports of the asked one's."""
    upstream_body = {**body, "model": model.upstream_model}
    if model is asked:
        return upstream_body
    asked_tokens = body.get("max_tokens")
    if type(asked_tokens) is int:  # else the upstream says what is wrong with it
        upstream_body["max_tokens"] = min(asked_tokens, model.max_output_tokens)
        _fit_thinking(upstream_body)
    output_config = body.get("output_config")
    effort = output_config.get("effort") if isinstance(output_config, dict) else None
    if effort is not None and effort not in model.efforts:
        rest = {k: v for k, v in body["output_config"].items() if k != "effort"}
        if rest:
            upstream_body["output_config"] = rest
        else:
            del upstream_body["output_config"]
    if not model.sampling:
        for field in ("temperature", "top_p"):
            upstream_body.pop(field, None)
    return upstream_body


# The least thinking budget the upstream takes.
MIN_THINKING_BUDGET = 1024


def _fit_thinking(body: dict[str, Any]) -> None:
    """A thinking budget (Anthropic's route sends it as the client wrote it) kept below a
    fallback's lower max_tokens, as the upstream requires; thinking is left out when no budget
    the upstream takes fits."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or type(thinking.get("budget_tokens")) is not int:
        return
    if thinking["budget_tokens"] < body["max_tokens"]:
        return
    if body["max_tokens"] <= MIN_THINKING_BUDGET:
        del body["thinking"]
    else:
        body["thinking"] = {**thinking, "budget_tokens": body["max_tokens"] - 1}


def _all_cooling(seconds: float) -> GatewayError:
    return GatewayError(
        503,
        "No deployment of this model is available right now.",
        type="server_error",
        code="overloaded",
        headers=retry_after(seconds),
    )
