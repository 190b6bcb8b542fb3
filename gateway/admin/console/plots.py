"""The console's plots, as inline SVG: spend per day as bars, and a key's spend against its budget.

They draw numbers they are given (the usage report's, gateway/admin/commands.py, which the admin API and
the CLI print): nothing here adds spend up."""

from __future__ import annotations

from datetime import date, timedelta
from decimal import Decimal

from gateway.admin.console.html import text, usd

WIDTH, HEIGHT = 760, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 14, 28  # the margins around the plotting area


def spend_per_day(spend: dict[date, Decimal], first: date, last: date, *, label: str) -> str:
    """Bars of spend per day, one per day from `first` to `last` that has any; days without
    spend have none. Each bar's <title> says its day and amount (a tooltip)."""
    days = (last - first).days + 1
    shown = {day: amount for day, amount in spend.items() if first <= day <= last and amount > 0}
    top = max(shown.values(), default=Decimal(0))
    width, height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = width / days
    parts = [
        f'<svg class="spend-per-day" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{text(label)}">',
        f"<title>{text(label)}</title>",
        f'<line x1="{LEFT}" y1="{TOP + height}" x2="{LEFT + width}" y2="{TOP + height}"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + height}"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">{text(usd(top))}</text>',
        f'<text x="{LEFT - 6}" y="{TOP + height}" text-anchor="end">$0</text>',
    ]
    middle = first + timedelta(days=days // 2)
    for day, x, anchor in (  # the axis' dates: the first, the middle one and the last
        (first, LEFT, "start"),
        (middle, LEFT + ((middle - first).days + 0.5) * slot, "middle"),
        (last, LEFT + width, "end"),
    ):
        parts.append(f'<text x="{x:.1f}" y="{HEIGHT - 8}" text-anchor="{anchor}">{day.isoformat()}</text>')
    for day, amount in sorted(shown.items()):
        bar = max(1.0, float(amount / top) * height)
        x = LEFT + (day - first).days * slot + slot * 0.15
        parts.append(
            f'<rect class="bar" data-day="{day.isoformat()}" data-cost-usd="{text(amount)}" '
            f'x="{x:.1f}" y="{TOP + height - bar:.1f}" width="{slot * 0.7:.1f}" height="{bar:.1f}">'
            f"<title>{day.isoformat()}: {text(usd(amount))}</title></rect>"
        )
    if not shown:
        parts.append(f'<text x="{LEFT + width / 2}" y="{TOP + height / 2}" text-anchor="middle">no spend</text>')
    parts.append("</svg>")
    return "".join(parts)


def budget_bar(spent: Decimal, limit: Decimal | None) -> str:
    """A key's (or an organization's) spend against its limit: a bar filled by the share used
    (red once it is all used), and the figures; just the spend when there is no limit."""
    if limit is None:
        return f"{text(usd(spent))} <span class=muted>(no limit)</span>"
    share = 1.0 if limit <= 0 else min(1.0, float(spent / limit))
    width, height = 120, 10
    kind = "over" if share >= 1.0 else "used"
    percent = "100%+" if limit <= 0 and spent > 0 else f"{share * 100:.0f}%"
    return (
        f'<svg class="budget" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{text(percent)} of the budget used">'
        f'<rect class="track" width="{width}" height="{height}"/>'
        f'<rect class="{kind}" width="{share * width:.1f}" height="{height}"/></svg> '
        f"{text(usd(spent))} of {text(usd(limit))} ({text(percent)})"
    )
