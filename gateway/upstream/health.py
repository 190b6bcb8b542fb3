"""Which deployments are worth trying: one that keeps failing is cooled down (not tried) for a
while, then tried again by the next request that needs it. When the upstream says how long to
stay away (`retry-after`), that is the cool-down. Kept per process: nothing to share."""

from __future__ import annotations

import time
from collections.abc import Iterable

from gateway.ops.metrics import NO_METRICS, Metrics, NoMetrics


class Health:
    def __init__(
        self, *, failures_before_cooldown: int = 3, cooldown: float = 30.0, metrics: Metrics | NoMetrics = NO_METRICS
    ) -> None:
        self._threshold = failures_before_cooldown
        self._cooldown = cooldown
        self._failures: dict[str, int] = {}
        self._cooled_until: dict[str, float] = {}  # until it answers again
        self._metrics = metrics

    def available(self, names: Iterable[str]) -> list[str]:
        now = time.monotonic()
        return [name for name in names if self._cooled_until.get(name, 0.0) <= now]

    def cooling_ends(self, names: Iterable[str]) -> float:
        """Seconds until the first of `names` may be tried again."""
        now = time.monotonic()
        return max(0.0, min((self._cooled_until.get(name, now) for name in names), default=now) - now)

    def failed(self, name: str, retry_after: float | None = None) -> None:
        failures = self._failures[name] = self._failures.get(name, 0) + 1
        if retry_after or failures >= self._threshold:
            self._cooled_until[name] = time.monotonic() + (retry_after or self._cooldown)
            self._metrics.cooling(name, True)

    def succeeded(self, name: str) -> None:
        self._failures.pop(name, None)
        if self._cooled_until.pop(name, None) is not None:  # tried again, and answered
            self._metrics.cooling(name, False)
