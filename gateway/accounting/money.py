"""Amounts of USD as text: one precision for people (the CLI's tables, the console) and one for
machines (the admin API's JSON and CSV, `usage --format json|csv`), so that no two rows of a table
or two pages disagree on how many digits an amount has."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

PLACES_SHOWN = 4  # a cheap request costs hundredths of a cent: cents alone would read as free
PLACES_EXACT = 9  # billionths, the unit reservations count in and the finest a limit may be

_SHOWN = Decimal(1).scaleb(-PLACES_SHOWN)
_EXACT = Decimal(1).scaleb(-PLACES_EXACT)


def usd_text(amount: Decimal | int | str, *, symbol: bool = True) -> str:
    """An amount (never below 0) for people, always PLACES_SHOWN decimals: "$1,234.5000",
    "$0.0037", and "<$0.0001" for an amount above 0 that would round to nothing. Without
    `symbol` (a table whose column says USD) no "$" and no thousands separators: "1234.5000"."""
    amount = Decimal(amount)
    sign = "$" if symbol else ""
    if 0 < amount < _SHOWN:
        return f"<{sign}{_SHOWN}"
    rounded = amount.quantize(_SHOWN, rounding=ROUND_HALF_EVEN)
    return f"{sign}{rounded:,f}" if symbol else f"{rounded:f}"


def usd_exact(amount: Decimal | int | str) -> str:
    """An amount for machines: a plain decimal string of PLACES_EXACT decimals ("12.500000000"),
    never an exponent ("2.1E-7")."""
    return f"{Decimal(amount).quantize(_EXACT, rounding=ROUND_HALF_EVEN):f}"
