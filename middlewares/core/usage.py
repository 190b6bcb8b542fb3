"""Token usage as the gateway counts it, from Anthropic's usage numbers, and what it costs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import orjson

from middlewares.core.protocols import ModelSpec, Pricing, Rates, TierRates

PER_MILLION = Decimal(1_000_000)
PER_THOUSAND = Decimal(1_000)


def estimate_tokens(chars: int) -> int:
    """Tokens in `chars` characters of text, when the upstream does not say (about 4 a token)."""
    return (chars + 3) // 4


# An upstream's output count below one token per this many characters of what the answer
# carried cannot be true: no tokenizer makes tokens that long.
CHARS_PER_TOKEN_AT_MOST = 10


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0  # uncached input
    cache_write_tokens: int = 0  # for 5 minutes and for an hour
    cache_read_tokens: int = 0
    output_tokens: int = 0  # reasoning included
    reasoning_tokens: int = 0
    cache_write_1h_tokens: int = 0  # of cache_write_tokens, those written for an hour (dearer)
    web_search_requests: int = 0  # the upstream's server tools, each use priced as the model's pricing says
    web_fetch_requests: int = 0
    service_tier: str | None = None  # the tier the upstream says served it: "standard", "priority", "batch"
    # What the upstream's usage said that the ledger does not price: a field ("name", "part.name")
    # or a value that may cost more than the ledger knows ("speed='fast'").
    unknown: tuple[str, ...] = field(default=(), compare=False)
    # Why the output is the gateway's estimate, not the upstream's count: "missing" (no final
    # count: a stream cut short, a client gone, a reply without usage) or "implausible".
    estimated: str | None = field(default=None, compare=False)

    @classmethod
    def from_anthropic(
        cls, usage: dict[str, Any], thinking_chars: int = 0, output_chars: int = 0, *, final: bool = True
    ) -> Usage:
        """Anthropic's usage, for an answer that carried `output_chars` characters of text and
        tool input and `thinking_chars` of thinking; `final`: the output count is the answer's
        last word (a stream's message_delta has come).

        Every number is the upstream's own. The output is estimated from those characters (4
        a token) only where the upstream's count is missing or cannot be true (fewer than one
        token per 10 characters); the estimate is then billed, and `estimated` says why.
        Reasoning is Anthropic's `thinking_tokens`, else estimated from the thinking text;
        never more than the output. Server tools' uses and the service tier are the upstream's."""
        reported: int | None = usage.get("output_tokens")
        if type(reported) is not int:
            reported = None
        chars = output_chars + thinking_chars
        if not final or reported is None:
            estimated = "missing"
        elif reported * CHARS_PER_TOKEN_AT_MOST < chars:
            estimated = "implausible"
        else:
            estimated = None
        if estimated is None and reported is not None:  # (never None then: `estimated` says so)
            output = reported
        else:
            output = max(reported or 0, estimate_tokens(output_chars) + estimate_tokens(thinking_chars))
        reasoning: int | None = (usage.get("output_tokens_details") or {}).get("thinking_tokens")
        if reasoning is None:
            reasoning = estimate_tokens(thinking_chars)
        cache_write = usage.get("cache_creation_input_tokens") or 0
        tools = usage.get("server_tool_use")
        tools = tools if isinstance(tools, dict) else {}
        tier = usage.get("service_tier")
        return cls(
            input_tokens=usage.get("input_tokens") or 0,
            cache_write_tokens=cache_write,
            cache_read_tokens=usage.get("cache_read_input_tokens") or 0,
            output_tokens=output,
            reasoning_tokens=min(reasoning, output),
            cache_write_1h_tokens=min(
                (usage.get("cache_creation") or {}).get("ephemeral_1h_input_tokens") or 0, cache_write
            ),
            web_search_requests=_uses(tools.get("web_search_requests")),
            web_fetch_requests=_uses(tools.get("web_fetch_requests")),
            service_tier=tier if isinstance(tier, str) else None,
            unknown=_unknown(usage),
            estimated=estimated,
        )

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> Usage:
        """A whole (non-streamed) message's usage; the text, thinking and tool input it carried
        back the estimates, as a stream's deltas do (a tool's input counts as its JSON)."""
        thinking_chars = output_chars = 0
        for block in message.get("content") or ():
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text":
                output_chars += _length(block.get("text"))
            elif kind == "thinking":
                thinking_chars += _length(block.get("thinking"))
            elif kind in _TOOL_CALLS:
                output_chars += len(orjson.dumps(block.get("input") or {}))
        return cls.from_anthropic(message.get("usage") or {}, thinking_chars, output_chars)

    @property
    def prompt_tokens(self) -> int:
        """All input, cached or not (Anthropic's input_tokens leaves cache reads and writes out)."""
        return self.input_tokens + self.cache_write_tokens + self.cache_read_tokens

    def rates(self, pricing: Pricing) -> Rates:
        """The rates every token of the request is billed at: its service tier's where the
        pricing gives them, else the standard tier's; and that tier's long-context rates when its
        input, cache reads and writes included, is above their threshold (the whole request then,
        as Anthropic bills it)."""
        return at_length(_tier_rates(pricing, self.service_tier) or pricing, self.prompt_tokens)

    def cost(self, pricing: Pricing) -> Decimal:
        """Exact USD: each kind of token at its rate per million, and each server tool's uses at
        its fee per 1,000."""
        rates = self.rates(pricing)
        tokens = (
            self.input_tokens * rates.input
            + (self.cache_write_tokens - self.cache_write_1h_tokens) * rates.cache_write
            + self.cache_write_1h_tokens * rates.cache_write_1h
            + self.cache_read_tokens * rates.cache_read
            + self.output_tokens * rates.output
        )
        uses = (
            self.web_search_requests * pricing.web_search_per_1000
            + self.web_fetch_requests * pricing.web_fetch_per_1000
        )
        return tokens / PER_MILLION + uses / PER_THOUSAND

    def unpriced(self, pricing: Pricing) -> tuple[str, ...]:
        """What the usage said that `pricing` does not price: its unknown fields and values, and
        a service tier other than standard that the pricing gives no rates for (billed at the
        standard tier's)."""
        tier = self.service_tier
        if tier in ("priority", "batch") and _tier_rates(pricing, tier) is None:
            return (*self.unknown, f"service_tier={tier!r}")
        return self.unknown


class StreamUsage:
    """A stream's usage, metered once as its events are read, for every stage that needs it
    (billing, the translator), as `MessageReply.usage` is for a whole message: Anthropic's
    numbers (message_start's, then message_delta's) and the text seen, which backs the
    estimate where the upstream's count is missing or cannot be true.

    A batch's events are dicts, or (where the gateway relays the upstream's bytes) bytes: a
    run of content_block_delta events it does not parse, counted by their size, in the block
    the last content_block_start opened."""

    def __init__(self) -> None:
        self.numbers: dict[str, Any] = {}
        self.final = False  # message_delta gave the output count
        self.thinking_chars = 0
        self.output_chars = 0  # text and tool arguments
        self.message_id: str | None = None  # the upstream message's (message_start)
        self.response_model: str | None = None  # the model the upstream says answered (message_start)
        self.stop_reason: str | None = None  # why it stopped (message_delta)
        self._block: str | None = "text"  # the open content block's type, for relayed deltas
        self._envelope: int | None = None  # the bytes of its deltas that are not their text

    def count(self, batch: list[dict[str, Any] | bytes]) -> None:
        for event in batch:
            if isinstance(event, bytes):
                self._count_relayed(event)
                continue
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
            elif kind == "content_block_start":  # a block may start with some text (sent on too)
                block = event.get("content_block") or {}
                self._block, self._envelope = block.get("type"), None
                if self._block == "text":
                    self.output_chars += _length(block.get("text"))
                elif self._block == "thinking":
                    self.thinking_chars += _length(block.get("thinking"))
            elif kind == "message_start":
                message = event.get("message") or {}
                self.numbers.update(message.get("usage") or {})
                self.message_id = message.get("id")
                self.response_model = message.get("model")
            elif kind == "message_delta":
                # Numbers it repeats override message_start's; one it sends as null does not.
                usage = event.get("usage") or {}
                self.numbers.update((name, n) for name, n in usage.items() if n is not None)
                self.final = self.final or usage.get("output_tokens") is not None
                self.stop_reason = (event.get("delta") or {}).get("stop_reason")

    def _count_relayed(self, run: bytes) -> None:
        """The characters a run of relayed content_block_deltas carried, from its size: each
        delta's bytes less its envelope, which the block's first delta measures (the upstream
        writes its deltas alike); a signature is no text the model wrote."""
        if self._block not in _TEXT_BLOCKS:  # a block of no text (redacted thinking, a server tool's results)
            return
        if self._envelope is None:
            self._envelope = _envelope_of(run[: run.find(b"\n\n") + 2])
        envelope = self._envelope
        size = len(run) - run.count(b"\n\n") * envelope
        if self._block == "thinking":
            at = run.find(b'"signature_delta"')
            if at >= 0:  # less its event, whole (its envelope is already off)
                start = run.rfind(b"\n\n", 0, at)
                start = start + 2 if start >= 0 else 0
                size -= run.find(b"\n\n", at) + 2 - start - envelope
            self.thinking_chars += max(size, 0)
        else:
            self.output_chars += max(size, 0)

    def total(self) -> Usage:
        """The usage so far: the upstream's numbers, its output estimated from the text seen
        where its count is missing (a stream cut short has none yet: the upstream sends it at
        the end) or cannot be true."""
        return Usage.from_anthropic(self.numbers, self.thinking_chars, self.output_chars, final=self.final)


# The blocks whose deltas carry what the model wrote.
_TEXT_BLOCKS = frozenset({"text", "thinking", "tool_use", "server_tool_use", "mcp_tool_use"})
# A text delta's bytes that are not its text, as Anthropic writes it: for a delta not read.
_ENVELOPE = len(
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":""}}\n\n'
)


def _envelope_of(event: bytes) -> int:
    """The bytes of one relayed delta event that are not its text (its one string besides the
    type), however the upstream spaces and orders its JSON."""
    try:
        delta = orjson.loads(event[event.index(b"data:") + 5 :])["delta"]
        text = next(value for name, value in delta.items() if name != "type" and isinstance(value, str))
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return _ENVELOPE
    return len(event) - len(orjson.dumps(text)) + 2


# The blocks whose `input` is what the model wrote (a stream's input_json_delta, whole).
_TOOL_CALLS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})


def _length(text: Any) -> int:
    return len(text) if isinstance(text, str) else 0


def _uses(count: Any) -> int:
    return count if type(count) is int and count > 0 else 0


def at_length(tier: TierRates, prompt_tokens: int) -> Rates:
    """`tier`'s rates for a request of `prompt_tokens` (input, cache reads and writes): its
    long-context ones above their threshold."""
    long = tier.long_context
    return long if long is not None and prompt_tokens > long.above_input_tokens else tier


def pricing_at(model: ModelSpec, deployment: str | None) -> Pricing:
    """What a request `model` answered at `deployment` is billed at: the model's own
    `pricing_at` where it has one (a `PricedPerDeployment`), else its `pricing`."""
    at: Callable[[str | None], Pricing] | None = getattr(model, "pricing_at", None)
    return model.pricing if at is None else at(deployment)


def every_pricing(model: ModelSpec) -> Sequence[Pricing]:
    """Each pricing a request `model` answers may be billed at, whichever deployment answers:
    the model's own `every_pricing` where it has one (a `PricedPerDeployment`), else its `pricing`."""
    every: Sequence[Pricing] | None = getattr(model, "every_pricing", None)
    return (model.pricing,) if every is None else every


def possible_rates(pricing: Pricing, prompt_tokens: int) -> tuple[Rates, ...]:
    """Every table a request of `prompt_tokens` may be billed at, whichever service tier the
    upstream answers it in (Anthropic's default, `auto`, may answer in priority)."""
    return tuple(
        at_length(tier, prompt_tokens) for tier in (pricing, pricing.priority, pricing.batch) if tier is not None
    )


def _tier_rates(pricing: Pricing, tier: str | None) -> TierRates | None:
    return pricing.priority if tier == "priority" else pricing.batch if tier == "batch" else None


# The service tiers Anthropic reports; the pricing gives each its rates.
_TIERS = frozenset({"standard", "priority", "batch"})
# Anthropic's usage as the ledger reads it: the counts it prices, the objects whose parts it
# knows, and the fields whose values it knows (the others may cost more: the US-only region, the
# fast mode). Anything else is `Usage.unknown`, so that a new price is noticed.
_COUNTS = frozenset({"input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"})
_PARTS = {
    "cache_creation": frozenset({"ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens"}),
    "output_tokens_details": frozenset({"thinking_tokens"}),
    "server_tool_use": frozenset({"web_search_requests", "web_fetch_requests"}),
}
_VALUES = {"service_tier": _TIERS, "speed": frozenset({"standard"}), "inference_geo": frozenset({"global"})}


def _unknown(usage: dict[str, Any]) -> tuple[str, ...]:
    """The fields of `usage` the ledger does not know, and the values it does not know of those
    it does (a null says nothing, and is passed over)."""
    found: list[str] = []
    for name, value in usage.items():
        if value is None or name in _COUNTS:
            continue
        parts, values = _PARTS.get(name), _VALUES.get(name)
        if parts is not None and isinstance(value, dict):
            found += [f"{name}.{part}" for part, n in value.items() if n is not None and part not in parts]
        elif values is not None:
            if not (isinstance(value, str) and value in values):
                found.append(f"{name}={value!r:.60}")  # the upstream's text, cut to a log line's share
        else:
            found.append(name)
    return tuple(found)
