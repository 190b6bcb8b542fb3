"""OpenAI's `reasoning_effort` values, and what each asks of the upstream."""

from __future__ import annotations

from typing import Any

# reasoning_effort → (the upstream's effort, thinking requested).
EFFORTS = {
    "none": ("low", False),
    "minimal": ("low", False),
    "low": ("low", True),
    "medium": ("medium", True),
    "high": ("high", True),
    "xhigh": ("xhigh", True),
    "max": ("max", True),
}
UNKNOWN_EFFORT = "reasoning_effort: use one of " + ", ".join(EFFORTS)


def known_effort(value: Any) -> bool:
    """Whether `value` is a reasoning_effort the gateway takes (absent, None, counts as known)."""
    return value is None or (isinstance(value, str) and value in EFFORTS)
