"""Token usage as the gateway counts it, from Anthropic's usage numbers, and what it costs."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from middlewares.core.protocols import Pricing

_PER_MILLION = Decimal(1_000_000)


def estimate_tokens(chars: int) -> int:
    """Tokens in `chars` characters of text, when the upstream does not say (about 4 a token)."""
    return (chars + 3) // 4


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0  # uncached input
    cache_write_tokens: int = 0
    cache_read_tokens: int = 0
    output_tokens: int = 0  # reasoning included
    reasoning_tokens: int = 0

    @classmethod
    def from_anthropic(cls, usage: dict[str, Any], thinking_chars: int = 0) -> Usage:
        """Anthropic's usage; reasoning is its `thinking_tokens`, else estimated from the
        thinking text seen (never more than the output)."""
        output = usage.get("output_tokens") or 0
        reasoning = (usage.get("output_tokens_details") or {}).get("thinking_tokens")
        if reasoning is None:
            reasoning = min(estimate_tokens(thinking_chars), output)
        return cls(
            input_tokens=usage.get("input_tokens") or 0,
            cache_write_tokens=usage.get("cache_creation_input_tokens") or 0,
            cache_read_tokens=usage.get("cache_read_input_tokens") or 0,
            output_tokens=output,
            reasoning_tokens=reasoning,
        )

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> Usage:
        """A whole (non-streamed) message's usage; its thinking text backs the reasoning estimate."""
        content = message.get("content") or ()
        thinking_chars = sum(len(block.get("thinking", "")) for block in content if isinstance(block, dict))
        return cls.from_anthropic(message.get("usage") or {}, thinking_chars)

    @property
    def prompt_tokens(self) -> int:
        """All input, cached or not (Anthropic's input_tokens leaves cache reads and writes out)."""
        return self.input_tokens + self.cache_write_tokens + self.cache_read_tokens

    def cost(self, pricing: Pricing) -> Decimal:
        """Exact USD: each kind of token at its price per million."""
        return (
            self.input_tokens * pricing.input
            + self.cache_write_tokens * pricing.cache_write
            + self.cache_read_tokens * pricing.cache_read
            + self.output_tokens * pricing.output
        ) / _PER_MILLION


class StreamUsage:
    """A stream's usage, metered once as its events are read, for every stage that needs it
    (billing, the translator), as `MessageReply.usage` is for a whole message: Anthropic's
    numbers (message_start's, then each message_delta's) and the text seen, which backs the
    estimates (reasoning from the thinking text; the output of a stream cut short)."""

    def __init__(self) -> None:
        self.numbers: dict[str, Any] = {}
        self.thinking_chars = 0
        self.output_chars = 0  # text and tool arguments

    def count(self, batch: list[dict[str, Any]]) -> None:
        for event in batch:
            kind = event["type"]
            if kind == "content_block_delta":
                delta = event.get("delta") or {}
                dtype = delta.get("type")
                if dtype == "text_delta":
                    self.output_chars += len(delta.get("text", ""))
                elif dtype == "input_json_delta":
                    self.output_chars += len(delta.get("partial_json", ""))
                elif dtype == "thinking_delta":
                    self.thinking_chars += len(delta.get("thinking", ""))
            elif kind == "message_start":
                self.numbers.update((event.get("message") or {}).get("usage") or {})
            elif kind == "message_delta":
                self.numbers.update(event.get("usage") or {})

    def total(self) -> Usage:
        """The usage of a stream that ended: the upstream's numbers."""
        return Usage.from_anthropic(self.numbers, self.thinking_chars)

    def so_far(self) -> Usage:
        """The usage of a stream cut short: the output estimated from the text seen, when the
        upstream's own count (it sends one at the end) is lower or missing."""
        seen = estimate_tokens(self.output_chars) + estimate_tokens(self.thinking_chars)
        output = max(self.numbers.get("output_tokens") or 0, seen)
        return Usage.from_anthropic({**self.numbers, "output_tokens": output}, self.thinking_chars)
