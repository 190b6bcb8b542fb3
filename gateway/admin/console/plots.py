"""The console's plots, as inline SVG: spend and requests per day as bars, and a key's spend
against its budget.

They draw numbers they are given (the usage report's, gateway/accounting/usage.py, which the
admin API and the CLI print): nothing here adds spend up."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from datetime import date, timedelta
from decimal import Decimal

from gateway.accounting.money import usd_text
from gateway.admin.console.html import text

WIDTH, HEIGHT = 760, 220
LEFT, RIGHT, TOP, BOTTOM = 84, 12, 14, 28  # the margins around the plotting area: the left holds the amounts
TICKS = 4  # about this many steps up the vertical axis
LABEL_EVERY = 7  # days between the dates under the horizontal axis, counted back from the last


def spend_per_day(spend: dict[date, Decimal], first: date, last: date, *, label: str) -> str:
    """Bars of spend per day (see per_day), the vertical axis in USD."""
    return per_day(
        spend, first, last, label=label, kind="spend-per-day", unit=usd_text, attribute="data-cost-usd", whole=False
    )


def requests_per_day(requests: dict[date, int], first: date, last: date, *, label: str) -> str:
    """Bars of requests per day (see per_day): spend's companion, which tells a day of many cheap
    requests from one of a few dear ones."""

    def unit(count: Decimal) -> str:
        return f"{count:,}"

    return per_day(
        requests, first, last, label=label, kind="requests-per-day", unit=unit, attribute="data-requests", whole=True
    )


def per_day(
    values: Mapping[date, Decimal | int],
    first: date,
    last: date,
    *,
    label: str,
    kind: str,
    unit: Callable[[Decimal], str],
    attribute: str,
    whole: bool,
) -> str:
    """Bars of a figure per day, one per day from `first` to `last` that has any above 0 (its
    figure in `attribute`, and in its <title>, a tooltip). The vertical axis is marked and ruled
    at round steps written by `unit`; the horizontal one has a tick per day, and its date every
    LABEL_EVERY days back from `last`. `whole`: the figure is a count, its steps whole numbers."""
    days = (last - first).days + 1
    shown = {day: Decimal(value) for day, value in values.items() if first <= day <= last and value > 0}
    steps = _steps(max(shown.values(), default=Decimal(0)), whole=whole)
    top = steps[-1]
    width, height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = width / days
    parts = [
        f'<svg class="{kind}" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{text(label)}">',
        f"<title>{text(label)}</title>",
    ]
    for step in steps:
        y = TOP + height - float(step / top) * height
        parts.append(
            f'<line class="{"axis" if step == 0 else "rule"}" x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + width}" y2="{y:.1f}"/>'
        )
        parts.append(f'<text class="step" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{text(unit(step))}</text>')
    for n in range(days):
        day, x = first + timedelta(days=n), LEFT + (n + 0.5) * slot
        labelled = (last - day).days % LABEL_EVERY == 0
        parts.append(
            f'<line class="axis" x1="{x:.1f}" y1="{TOP + height}" x2="{x:.1f}" y2="{TOP + height + (5 if labelled else 2)}"/>'
        )
        if labelled:
            parts.append(
                f'<text class="date" x="{x:.1f}" y="{HEIGHT - 8}" text-anchor="middle">{day.strftime("%b %d")}</text>'
            )
    for day, value in sorted(shown.items()):
        bar = max(1.0, float(value / top) * height)
        x = LEFT + (day - first).days * slot + slot * 0.15
        parts.append(
            f'<rect class="bar" data-day="{day.isoformat()}" {attribute}="{text(value)}" '
            f'x="{x:.1f}" y="{TOP + height - bar:.1f}" width="{slot * 0.7:.1f}" height="{bar:.1f}">'
            f"<title>{day.isoformat()}: {text(unit(value))}</title></rect>"
        )
    if not shown:
        parts.append(f'<text x="{LEFT + width / 2}" y="{TOP + height / 2}" text-anchor="middle">none</text>')
    parts.append("</svg>")
    return "".join(parts)


def _steps(top: Decimal, *, whole: bool) -> list[Decimal]:
    """The vertical axis' marks: 0 up to the first round step at or above `top`, about TICKS
    steps of 1, 2, 2.5 or 5 times a power of ten (whole numbers only, for counts)."""
    if top <= 0:
        return [Decimal(0), Decimal(1)]
    rough = top / TICKS
    power = Decimal(10) ** rough.adjusted()
    multiples = (1, 2, 5, 10) if whole else (1, 2, Decimal("2.5"), 5, 10)
    step = next(m * power for m in multiples if m * power >= rough)
    if whole:
        step = max(step, Decimal(1))
    return [step * n for n in range(math.ceil(top / step) + 1)]


def budget_bar(spent: Decimal, limit: Decimal | None) -> str:
    """A key's (or an organization's) spend against its limit: a bar filled by the share used
    (red once it is all used), and the figures; just the spend when there is no limit."""
    if limit is None:
        return f"{text(usd_text(spent))} <span class=muted>(no limit)</span>"
    share = 1.0 if limit <= 0 else min(1.0, float(spent / limit))
    width, height = 120, 10
    kind = "over" if share >= 1.0 else "used"
    percent = "100%+" if limit <= 0 and spent > 0 else f"{share * 100:.0f}%"
    return (
        f'<svg class="budget" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{text(percent)} of the budget used">'
        f'<rect class="track" width="{width}" height="{height}"/>'
        f'<rect class="{kind}" width="{share * width:.1f}" height="{height}"/></svg> '
        f"{text(usd_text(spent))} of {text(usd_text(limit))} ({text(percent)})"
    )
