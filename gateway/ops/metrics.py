"""The gateway's Prometheus metrics (docs/operations.md lists them: their names and labels are a
contract). Every label is bounded: a route, a configured model or deployment, a status, an
outcome; never a key, a prompt, a URL or a session.

One `Metrics` per app. Under `serve --workers N` the parent sets PROMETHEUS_MULTIPROC_DIR before
the workers start, so prometheus-client keeps each worker's values in that directory and one
scrape of any worker adds up all of them. The hot path binds a label set's child once and reuses
it; nothing is counted per stream event.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE

from gateway.config import Deployment
from middlewares.core.errors import GatewayError
from middlewares.core.records import LedgerRow

# Seconds, up to the longest a request may take (a non-streaming one: 590 s).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
# ezat_tokens_total's types, and the ledger's column for each.
TOKEN_COLUMNS = (
    ("input", "input_tokens"),
    ("output", "output_tokens"),
    ("cache_read", "cache_read_tokens"),
    ("cache_write", "cache_write_tokens"),
    ("reasoning", "reasoning_tokens"),
)
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    return bool(os.environ.get(MULTIPROCESS_DIR))


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()  # the app's own: a test process runs many apps
        route_model = ["route", "model"]
        self._requests = Counter(
            "ezat_requests", "Requests answered, by route, model and status.", ["route", "model", "status"], registry=r
        )
        self._duration = Histogram(
            "ezat_request_duration_seconds",
            "From the request to the end of its answer.",
            route_model,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._first_token = Histogram(
            "ezat_time_to_first_token_seconds",
            "From the request to the model's first output (a whole answer, unstreamed).",
            route_model,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._tokens = Counter(
            "ezat_tokens", "Tokens billed, by the model that answered and their kind.", ["model", "type"], registry=r
        )
        self._cost = Counter("ezat_cost_usd", "USD billed, by the model that answered.", ["model"], registry=r)
        self._attempts = Counter(
            "ezat_upstream_attempts",
            "Requests sent to a deployment, by what came of them.",
            ["deployment", "outcome"],
            registry=r,
        )
        self._fallbacks = Counter(
            "ezat_fallbacks", "Requests answered by a fallback model.", ["model", "fallback"], registry=r
        )
        self._cooling = Gauge(
            "ezat_deployment_cooling",
            "1 while a deployment is cooling down after failures.",
            ["deployment"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self._deployment_info = Gauge(
            "ezat_deployment_info",
            "1 for each configured deployment, naming its provider: anthropic, bedrock or vertex.",
            ["deployment", "provider"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self._open_streams = Gauge(
            "ezat_open_streams", "Streams being answered.", registry=r, multiprocess_mode="livesum"
        )
        self._ledger_rows = Counter("ezat_ledger_rows", "Ledger rows committed.", registry=r)
        self._commit = Histogram(
            "ezat_ledger_commit_seconds", "How long a ledger batch took to commit.", buckets=COMMIT_BUCKETS, registry=r
        )
        self._pending = Gauge(
            "ezat_ledger_pending", "Ledger rows waiting for their commit.", registry=r, multiprocess_mode="livesum"
        )
        self._refused = Counter(
            "ezat_refused", "Requests the gateway refused before any upstream, by why.", ["reason"], registry=r
        )
        self._downloads = Counter(
            "ezat_image_downloads", "Image and PDF downloads, by what came of them.", ["outcome"], registry=r
        )
        self._alerts = Counter(
            "ezat_alerts",
            "Spend alerts' deliveries, by what came of them: sent, failed (tried again later), given_up.",
            ["outcome"],
            registry=r,
        )
        self._store_unavailable = Counter(
            "ezat_store_unavailable",
            "Requests refused with 503 because the gateway's database could not be reached.",
            registry=r,
        )
        self._children: dict[tuple, Any] = {}  # a metric's child, or answered()'s pair of them

    def _child(self, metric, *labels: str | int):
        """The metric's child for these label values, bound once."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*(str(label) for label in labels))
        return child

    def exposition(self) -> bytes:
        """The text a scrape gets: this app's values, or every worker's under `--workers`."""
        if multiprocess_mode():
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)

    # --- what the gateway tells it

    def answered(self, route: str, model: str, status: int, seconds: float, first_output: float | None) -> None:
        children = self._children.get((route, model, status))
        if children is None:  # the two every answer counts in, bound once
            children = self._children[(route, model, status)] = (
                self._requests.labels(route, model, str(status)),
                self._duration.labels(route, model),
            )
        requests, duration = children
        requests.inc()
        duration.observe(seconds)
        if first_output is not None:  # a series only for what has a first output
            self._child(self._first_token, route, model).observe(first_output)

    def refused(self, reason: str) -> None:
        self._child(self._refused, reason).inc()

    def store_unavailable(self) -> None:
        self._store_unavailable.inc()

    def attempt(self, deployment: str, outcome: str) -> None:
        self._child(self._attempts, deployment, outcome).inc()

    def fallback(self, model: str, fallback: str) -> None:
        self._child(self._fallbacks, model, fallback).inc()

    def deployments(self, deployments: Iterable[Deployment]) -> None:
        """The configured deployments and their providers, set once when the app is made."""
        for deployment in deployments:
            self._deployment_info.labels(deployment.name, deployment.provider).set(1)

    def cooling(self, deployment: str, cooling: bool) -> None:
        self._child(self._cooling, deployment).set(1 if cooling else 0)

    def open_streams(self, count: int) -> None:
        self._open_streams.set(count)

    def pending(self, rows: int) -> None:
        self._pending.set(rows)

    def committed(self, rows: Sequence[LedgerRow], seconds: float) -> None:
        """A batch's rows, added up by model first: one increment per model and kind, not per row."""
        self._ledger_rows.inc(len(rows))
        self._commit.observe(seconds)
        by_model: dict[str, list[LedgerRow]] = {}
        for row in rows:
            by_model.setdefault(row.answered_model, []).append(row)
        for model, mine in by_model.items():
            for kind, column in TOKEN_COLUMNS:
                tokens = sum(getattr(row, column) for row in mine)
                if tokens:
                    self._child(self._tokens, model, kind).inc(tokens)
            self._child(self._cost, model).inc(float(sum(row.cost_usd for row in mine)))

    def image_download(self, outcome: str) -> None:
        self._child(self._downloads, outcome).inc()

    def alert(self, outcome: str) -> None:
        self._child(self._alerts, outcome).inc()


class NoMetrics:
    """What an app without /metrics counts with: nothing, at the cost of a call."""

    def __getattr__(self, name: str):
        self.__dict__[name] = _nothing  # found directly from then on: __getattr__ runs after a failed lookup
        return _nothing


def _nothing(*args, **kwargs) -> None:
    pass


NO_METRICS = NoMetrics()


def metrics_handler(metrics: Metrics, token: str = ""):
    """GET /metrics; with `token`, only for `Authorization: Bearer <token>` (compared in
    constant time), else 401."""
    expected = f"Bearer {token}".encode()

    async def scrape(request: web.Request) -> web.Response:
        if token and not hmac.compare_digest(
            request.headers.get("Authorization", "").encode("utf-8", "surrogateescape"), expected
        ):
            raise GatewayError(
                401, "The metrics need `Authorization: Bearer <the [metrics] token>`.", code="invalid_api_key"
            )
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    return scrape
