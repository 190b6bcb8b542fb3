"""The application: its services, the four chains of stages (each in order, around its handler) and
its routes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial, update_wrapper
from typing import NamedTuple

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.accounting.alerts import Alerts
from gateway.accounting.ledger import Ledger
from gateway.accounting.ratelimit import RateLimiter, rate_limiter
from gateway.accounting.spending import SpendReservations
from gateway.admin.api import add_admin_routes
from gateway.admin.console import add_console_routes, is_console, refusal_page
from gateway.admin.device import add_device_routes
from gateway.admin.oidc import OidcClient
from gateway.admin.policies import governing
from gateway.admin.provider_tokens import ProviderTokens, Rechecks
from gateway.clock import Clock, system
from gateway.config import Config
from gateway.ops.metrics import NO_METRICS, Metrics, NoMetrics, metrics_handler
from gateway.ops.observe import API_ROUTES, observe_middleware
from gateway.ops.tracing import Tracing
from gateway.routes.catalog import catalog_handlers, speaks_anthropic
from gateway.routes.readiness import Readiness
from gateway.routes.stored_responses import KeptResponses, stored_response_handlers
from gateway.server import server_header
from gateway.storage import Store, open_store
from gateway.storage.unavailable import StoreOutage, StoreUnavailable
from gateway.upstream.client import UpstreamClient
from gateway.upstream.proxy import NON_STREAMING_DEADLINE, Attempts, count_tokens_handler, proxy_handler
from gateway.upstream.streams import OpenStreams
from middlewares.auth import AuthStage, auth_middleware
from middlewares.billing import billing_middleware
from middlewares.bounds import Bounds, bounds_middleware
from middlewares.cache_breakpoints import cache_breakpoints_middleware
from middlewares.core.chain import Endpoint, Stage, checked
from middlewares.core.context import request_id
from middlewares.core.errors import anthropic_error_envelope, error_envelope, error_event
from middlewares.core.reply import EventStreamReply
from middlewares.core.sizes import MiB
from middlewares.images import ImageLimits, ImagesStage, images_middleware
from middlewares.limits import RESERVATION_TTL, limits_middleware
from middlewares.native import native_middleware
from middlewares.refusals import refusals_middleware
from middlewares.responses import responses_middleware, responses_refusals_middleware
from middlewares.size_limit import size_limit_middleware
from middlewares.translator import translator_middleware


def chain(middlewares: list[Middleware], handler: Endpoint | Handler) -> Handler:
    """`handler` behind `middlewares`, the first one outermost, exactly as an aiohttp app would
    run them (each route gets the chain its API needs), once their order is checked."""
    if isinstance(handler, Endpoint):
        ordered, handler = checked(middlewares, handler), handler.handle
    else:
        ordered = checked(middlewares)
    for middleware in reversed(ordered):
        # A stage's own coroutine function, for aiohttp to see the route's handler is one.
        step = middleware.fn if isinstance(middleware, Stage) else middleware
        # By keyword, so the partial calls the stage itself (no frame of ours per stage): every
        # middleware here names its second parameter `handler`, which aiohttp's type leaves unnamed.
        handler = update_wrapper(partial(step, handler=handler), handler)  # type: ignore[call-arg]
    return handler


def build_app(
    config: Config,
    *,
    non_streaming_deadline: float = NON_STREAMING_DEADLINE,
    ping_interval: float = 15.0,
    key_cache_seconds: float = 5.0,
    tracing: Tracing | None = None,
    now: Clock = system,
    check_client_bytes: bool = False,
) -> web.Application:
    """The gateway's app. `tracing` replaces what [tracing] sets up (tests give an in-memory one);
    `now` is the gateway's idea of now, for budget periods (the CLI's reads `EZAT_NOW`);
    `check_client_bytes`: the proxy proves the client's bytes it sends on still make the body
    (the tests' gateways do; see middlewares/core/context.py)."""
    # What every route shares, and the stages the chains share.
    services = make_services(config, ping_interval=ping_interval, tracing=tracing, now=now)
    ttl = reservation_ttl(config, non_streaming_deadline)
    stages = make_stages(config, services, key_cache_seconds=key_cache_seconds, reservation_ttl=ttl, now=now)
    app = application(config, services, stages)
    # The four API routes: each one's chain, its order checked, around its handler.
    proxy = partial(
        proxy_handler,
        config,
        services.upstream,
        attempts=services.attempts,
        non_streaming_deadline=non_streaming_deadline,
        streams=services.streams,
        check_client_bytes=check_client_bytes,
    )
    count = count_tokens_handler(
        services.upstream,
        attempts=services.attempts,
        deadline=non_streaming_deadline,
        check_client_bytes=check_client_bytes,
    )
    chat_completions = api_route(app, "chat_completions", chain(openai_chain(stages), proxy()))
    responses = api_route(app, "responses", chain(responses_chain(stages), proxy()))
    messages = api_route(app, "messages", chain(messages_chain(stages), proxy(native=True)))
    count_tokens = api_route(app, "count_tokens", chain(count_tokens_chain(stages), count))
    add_routes(app, config, services, stages, chat_completions, responses, messages, count_tokens)
    add_stored_response_routes(app, services.kept, stages)
    provider = _provider_tokens(app, config)
    if provider is not None and config.oidc is not None:  # people asked about again, every so often
        rechecks = Rechecks(services.store, provider, config.oidc.recheck_minutes, stages.auth.forget, now)
        app.cleanup_ctx.append(rechecks.lifespan)
    if config.admin is not None:  # the admin API: no API chain, no billing (gateway/admin/api.py)
        add_admin_routes(app, config.admin, services.store, forget_key=stages.auth.forget, now=now)
        add_console_routes(  # /console
            app,
            config.admin,
            services.store,
            oidc=config.oidc,
            policies=config.policies,
            provider=provider,
            forget_key=stages.auth.forget,
            now=now,
        )
    # `ezat-gateway login`'s /oauth routes: with [oidc], else answering 404 in OAuth's own envelope.
    add_device_routes(app, services.store, oidc=config.oidc, policies=config.policies, now=now, provider=provider)
    return app


def _provider_tokens(app: web.Application, config: Config) -> ProviderTokens | None:
    """With [oidc], the app's one OpenID client (closed with the app), and people's refresh tokens
    sealed under a key derived from [admin] session_key (which [oidc] requires)."""
    if config.oidc is None or config.admin is None:
        return None
    provider = ProviderTokens(OidcClient(config.oidc), config.admin.session_signing_key)

    async def close(app: web.Application) -> None:
        await provider.client.close()

    app.on_cleanup.append(close)
    return provider


class Services(NamedTuple):
    """What every route shares, made once for the app: its metrics and traces, the upstream's
    connection pool, the store and what writes to it, the rate limiter, the open streams and the
    deployments' health."""

    metrics: Metrics | NoMetrics
    tracing: Tracing | None
    upstream: UpstreamClient
    store: Store
    ledger: Ledger
    spending: SpendReservations
    limiter: RateLimiter
    streams: OpenStreams
    attempts: Attempts
    readiness: Readiness
    kept: KeptResponses
    alerts: Alerts | None  # [[alerts]]' webhooks, when the config has any
    outage: StoreOutage  # the requests refused while the store cannot be reached


def make_services(config: Config, *, ping_interval: float, tracing: Tracing | None, now: Clock) -> Services:
    """The app's services, from the config; none is opened before the app starts. `now` dates
    budget periods."""
    metrics = Metrics() if config.metrics.enabled else NO_METRICS
    metrics.deployments(config.deployments)
    tracing = tracing or Tracing.from_config(config.tracing)
    upstream = UpstreamClient()
    store = open_store(config.storage.url, now=now)
    alerts = Alerts(config.alerts, store, metrics=metrics, now=now) if config.alerts else None
    ledger = Ledger(store, metrics=metrics, committed=alerts.spent if alerts else None)
    spending = SpendReservations(store)
    limiter = rate_limiter(config.ratelimit.url, workers=config.server.workers)
    return Services(
        metrics=metrics,
        tracing=tracing,
        upstream=upstream,
        store=store,
        ledger=ledger,
        spending=spending,
        limiter=limiter,
        streams=OpenStreams(ping_interval, config.server.write_timeout_seconds, metrics),
        attempts=Attempts(config, metrics=metrics, tracing=tracing),  # every route's: the deployments are the same
        readiness=Readiness(store, limiter),
        kept=KeptResponses(store, config.responses.retention_days),
        alerts=alerts,
        outage=StoreOutage(store.ping, counted=metrics.store_unavailable),
    )


class Stages(NamedTuple):
    """The stages the chains share, made once: one images stage means one download pool for
    the app, whichever API's shape it reads. `limits` makes a limits stage for an API."""

    auth: AuthStage
    size_limit: Callable
    native_size_limit: Callable  # keeps the client's bytes, which the Messages route may send on
    bounds: Callable
    limits: Callable[..., Callable]
    images: ImagesStage
    anthropic_images: Callable
    native: Callable
    billing: Callable
    responses_images: Callable
    reasoning_key: bytes  # seals the thinking a Responses client keeps, and opens it again
    kept_responses: KeptResponses  # the Responses API's stored responses


def make_stages(
    config: Config, services: Services, *, key_cache_seconds: float, reservation_ttl: float, now: Clock
) -> Stages:
    """The shared stages, each set up from its part of the config; `now` dates budget periods."""
    settings = config.images
    images = images_middleware(
        ImageLimits(
            image_bytes=settings.max_image_mb * MiB,
            urls=settings.max_urls,
            total_bytes=settings.max_total_mb * MiB,
            timeout=settings.timeout_seconds,
            redirects=settings.max_redirects,
            downloads_per_key=settings.downloads_per_key,
            connections_per_host=settings.connections_per_host,
        ),
        ports=settings.ports,
        allow_private_hosts=settings.allow_private_hosts,
        on_download=services.metrics.image_download,
    )
    return Stages(
        auth=auth_middleware(
            find_key=governing(services.store.find_key, config.policies),  # an admin's key passes as it is
            cache_seconds=key_cache_seconds,
        ),
        size_limit=size_limit_middleware(body_timeout=config.server.body_timeout_seconds),
        native_size_limit=size_limit_middleware(
            body_timeout=config.server.body_timeout_seconds, keep_client_bytes=True
        ),
        bounds=bounds_middleware(Bounds(**dataclasses.asdict(config.bounds))),  # [bounds]' keys are the stage's
        limits=partial(
            limits_middleware,
            find_model=config.model,
            spending=services.spending,
            limiter=services.limiter,
            reservation_ttl=reservation_ttl,
            now=now,
            used_up=services.alerts.used_up if services.alerts else None,
        ),
        images=images,
        anthropic_images=images.for_api("anthropic"),
        native=native_middleware(),
        billing=billing_middleware(record=services.ledger.record),
        responses_images=images.for_api("responses"),
        # [responses] reasoning_key's, the same on every replica; else the process's own, which
        # its workers share but no other replica has.
        reasoning_key=config.responses.sealing_key,
        kept_responses=services.kept,
    )


# The four chains, each in order, the first stage outermost.


def openai_chain(stages: Stages) -> list[Callable]:
    """Chat Completions: OpenAI's request translated to Anthropic's, and the reply back."""
    return [
        stages.auth,
        stages.size_limit,
        stages.bounds,
        refusals_middleware(),
        stages.limits(),
        stages.images,
        cache_breakpoints_middleware(),
        translator_middleware(),
        stages.billing,
    ]


def responses_chain(stages: Stages) -> list[Callable]:
    """OpenAI's Responses API: the chat route's chain with the Responses API's refusals, images
    and translation; the breakpoints go on the translated body, Anthropic's."""
    return [
        stages.auth,
        stages.size_limit,
        stages.bounds,
        responses_refusals_middleware(),
        stages.limits(api="responses"),
        stages.responses_images,
        responses_middleware(reasoning_key=stages.reasoning_key, store=stages.kept_responses),
        cache_breakpoints_middleware(api="anthropic"),
        stages.billing,
    ]


def messages_chain(stages: Stages) -> list[Callable]:
    """Anthropic's Messages API: the same chain, with no refusals or translator (docs/api.md)."""
    return [
        stages.auth,
        stages.native_size_limit,
        stages.bounds,
        stages.limits(api="anthropic"),
        stages.anthropic_images,
        cache_breakpoints_middleware(api="anthropic"),
        stages.native,
        stages.billing,
    ]


def count_tokens_chain(stages: Stages) -> list[Callable]:
    """Anthropic's count_tokens: admission that reserves nothing (a count costs nothing), and no billing."""
    return [
        stages.auth,
        stages.native_size_limit,
        stages.bounds,
        stages.limits(api="anthropic", reserve=False),
        stages.anthropic_images,
        stages.native,
    ]


def application(config: Config, services: Services, stages: Stages) -> web.Application:
    """The app with its two outer middlewares, its services opened on startup and closed on
    shutdown, and the headers on every answer."""
    store, ledger, spending, limiter = services.store, services.ledger, services.spending, services.limiter

    async def storage(app: web.Application):
        await store.open()
        await store.sync_config_organizations(config.organizations)
        await store.sync_config_keys(config.keys)
        yield
        await services.kept.close()  # the responses being written are kept before the store goes
        await ledger.close()  # every recorded row is written before the store goes
        await spending.close()
        await limiter.close()
        await store.close()

    async def end_streams_before_the_deadline(app: web.Application) -> None:
        # On SIGTERM the open requests get shutdown_timeout_seconds to finish. A stream that
        # would outlast it is ended shortly before with an error and [DONE], as a failed stream
        # is, and so is not billed; at the deadline, aiohttp would cut it with neither. (Ending
        # a stream right at the deadline races aiohttp's own timeout: InvalidStateError.)
        timeout = config.server.shutdown_timeout_seconds
        services.streams.end_all_after(timeout - min(1.0, timeout / 5), SHUTTING_DOWN)

    app = web.Application(
        middlewares=[
            observe_middleware(
                metrics=services.metrics,
                tracing=services.tracing,
                providers={deployment.name: deployment.provider for deployment in config.deployments},
            ),
            errors_as_the_client_speaks(services.outage),
        ]
    )
    app[STORE] = store
    app[API_ROUTES] = {}  # api_route names them
    app[READINESS] = services.readiness
    app.cleanup_ctx.append(storage)
    app.cleanup_ctx.append(services.outage.lifespan)
    app.cleanup_ctx.append(services.upstream.lifespan)
    app.cleanup_ctx.append(stages.images.cleanup_ctx)
    app.cleanup_ctx.append(services.streams.lifespan)
    if services.tracing is not None:
        app.cleanup_ctx.append(services.tracing.lifespan)
    if services.alerts is not None:
        app.cleanup_ctx.append(services.alerts.lifespan)
    app.on_response_prepare.append(_request_id_headers)
    app.on_response_prepare.append(server_header)  # no versions, on every answer the app makes
    app.on_shutdown.append(end_streams_before_the_deadline)
    app.on_shutdown.append(services.readiness.on_shutdown)
    return app


def add_routes(
    app: web.Application,
    config: Config,
    services: Services,
    stages: Stages,
    chat_completions: Callable,
    responses: Callable,
    messages: Callable,
    count_tokens: Callable,
) -> None:
    """Every route, under each prefix its clients use: the four API routes, the models (behind
    auth), the catalog, the probes and the metrics."""
    healthz, list_models, one_model, model_catalog = catalog_handlers(config)
    list_models = api_route(app, "models", chain([stages.auth], list_models))
    one_model = api_route(app, "models", chain([stages.auth], one_model))
    for prefix in ("", "/openai"):
        app.router.add_post(prefix + "/v1/chat/completions", chat_completions)
        app.router.add_post(prefix + "/v1/responses", responses)
    for prefix in ("", "/anthropic"):
        app.router.add_post(prefix + "/v1/messages", messages)
        app.router.add_post(prefix + "/v1/messages/count_tokens", count_tokens)
    for prefix in ("", "/openai", "/anthropic"):
        app.router.add_get(prefix + "/v1/models", list_models)
        app.router.add_get(prefix + "/v1/models/{model:.+}", one_model)  # ids hold a slash
    app.router.add_get("/api/models", model_catalog)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", services.readiness.readyz)
    if config.metrics.enabled:
        assert isinstance(services.metrics, Metrics)  # make_services made it for this
        app.router.add_get("/metrics", metrics_handler(services.metrics, config.metrics.token))


# --- Stored responses (the Responses API's): the stage's store, and the routes that read them.


def add_stored_response_routes(app: web.Application, kept: KeptResponses, stages: Stages) -> None:
    """GET and DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items, under both
    prefixes. Behind auth alone: a read of the key's own responses reserves nothing and costs no
    upstream call, so the limits stage, which admits a model's request, has nothing to weigh."""
    retrieve, delete, list_items = (
        api_route(app, "stored_responses", chain([stages.auth], handler)) for handler in stored_response_handlers(kept)
    )
    for prefix in ("", "/openai"):
        route = prefix + "/v1/responses/{response_id}"
        app.router.add_get(route, retrieve)
        app.router.add_delete(route, delete)
        app.router.add_get(route + "/input_items", list_items)


def reservation_ttl(config: Config, non_streaming_deadline: float) -> float:
    """Seconds a spend reservation outlives a process that died holding it: an hour, or longer
    than a request may run where the deadlines allow more (a stream's every attempt waiting its
    connect and first-token timeouts, then its maximum duration), with a minute to spare."""
    longest = max(
        (
            config.routing.max_attempts * (d.connect_timeout_seconds + d.first_token_timeout_seconds)
            + d.max_stream_duration_seconds
            for d in config.deployments
        ),
        default=0.0,
    )
    return max(RESERVATION_TTL, max(longest, non_streaming_deadline) + 60)


STORE = web.AppKey("ezat.store", Store)
READINESS = web.AppKey("ezat.readiness", Readiness)
SHUTTING_DOWN = error_event("The gateway is shutting down; send the request again.")


def api_route(app: web.Application, name: str, handler: Handler) -> Handler:
    """`handler`, named as the metrics and the access log call its route (others are not observed)."""
    app[API_ROUTES][handler] = name
    return handler


def errors_as_the_client_speaks(outage: StoreOutage):
    """The guard just inside `observe`: every error, aiohttp's own (404, 405) and anything
    unexpected too, in the envelope of the API the request speaks, Anthropic's or OpenAI's. A store
    that cannot be reached is no unexpected error but an outage: each request it stops is a 503
    (on the console, a page), told to `outage`, which logs it once and counts it; so is a stream
    whose end could not be recorded for it, which says so in the stream."""

    def stream_ended(reply: EventStreamReply) -> None:
        if isinstance(reply.failure, StoreUnavailable):  # its end could not be recorded
            outage.refused(reply.failure)

    async def refused_while_unavailable(request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except StoreUnavailable as unavailable:
            error = outage.refused(unavailable)
            if is_console(request.path):
                return refusal_page(error)
            raise error from None
        if isinstance(response, EventStreamReply):
            response.when_done(stream_ended)
        return response

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        envelope = anthropic_error_envelope if speaks_anthropic(request) else error_envelope
        return await envelope(request, partial(refused_while_unavailable, handler=handler))

    return guard


async def _request_id_headers(request: web.Request, response: web.StreamResponse) -> None:
    rid = request_id(request)
    response.headers["request-id"] = rid
    response.headers["x-request-id"] = rid
