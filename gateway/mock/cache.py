"""The mock upstream's prompt cache, modelled on Anthropic's: a breakpoint (`cache_control`)
caches the prompt up to and including its block (tools, then system, then messages); a later
request reads the longest cached prefix found at a breakpoint or up to 20 blocks before one;
prefixes shorter than the minimum are never cached. Tokens are counted as 4 bytes of JSON.
A top-level `cache_control` (automatic caching) is a breakpoint on the last block that is not
thinking.

It makes usage realistic (`cache_read_input_tokens`, `cache_creation_input_tokens` and its split
by time to live), and since each mock is one deployment, a conversation that moves to another
deployment loses its cache. Entries never expire: a TTL only decides how a write is billed. The
tokens written up to the last 1-hour breakpoint (if that prefix is long enough to cache) count
as 1-hour ones, the rest of the write as 5-minute ones (1-hour breakpoints come first, see
mock_validation).
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

LOOKBACK = 20  # block boundaries checked for a hit before each breakpoint


class PromptCache:
    def __init__(self, min_tokens: int = 1024) -> None:
        self.min_tokens = min_tokens
        self._prefixes: set[bytes] = set()

    def usage(self, body: dict[str, Any]) -> dict[str, int]:
        """input_tokens, cache_read_input_tokens, cache_creation_input_tokens and its split,
        ephemeral_5m_input_tokens and ephemeral_1h_input_tokens, for `body`, remembering the
        prefixes its breakpoints cache."""
        blocks = _prompt_blocks(body)
        sizes, keys = [], []
        size, digest = 0, hashlib.blake2b(digest_size=16)
        for block in blocks:
            encoded = _encoded(block)
            size += len(encoded) // 4
            digest.update(encoded)
            sizes.append(size)
            keys.append(digest.copy().digest())
        ttls = _breakpoints(body, blocks)
        marks = sorted(ttls)
        read = 0
        for mark in marks:
            for index in range(mark, max(-1, mark - LOOKBACK), -1):
                if keys[index] in self._prefixes:
                    read = max(read, sizes[index])
                    break
        written = one_hour = 0
        if marks and sizes[marks[-1]] >= self.min_tokens and keys[marks[-1]] not in self._prefixes:
            written = sizes[marks[-1]] - read
            hours = [mark for mark in marks if ttls[mark] == "1h" and sizes[mark] >= self.min_tokens]
            one_hour = max(0, sizes[hours[-1]] - read) if hours else 0
        self._prefixes.update(keys[mark] for mark in marks if sizes[mark] >= self.min_tokens)
        return {
            "input_tokens": max(1, size - read - written),
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": written,
            "ephemeral_5m_input_tokens": written - one_hour,
            "ephemeral_1h_input_tokens": one_hour,
        }


def prompt_tokens(body: dict[str, Any]) -> int:
    """The whole prompt's tokens, cached or not (what count_tokens answers): a reply's
    input_tokens + cache_read_input_tokens + cache_creation_input_tokens, except when the prompt is
    cached up to its last block, where input_tokens is still 1."""
    return sum(len(_encoded(block)) // 4 for block in _prompt_blocks(body))


def _encoded(block: Any) -> bytes:
    """A block's JSON without its breakpoint, which is neither counted nor part of the prefix."""
    if isinstance(block, dict) and "cache_control" in block:
        block = {k: v for k, v in block.items() if k != "cache_control"}
    return orjson.dumps(block)


def _breakpoints(body: dict[str, Any], blocks: list[Any]) -> dict[int, str]:
    """The index of each block that has a breakpoint, and its time to live."""
    marks = {
        index: block["cache_control"].get("ttl", "5m")
        for index, block in enumerate(blocks)
        if isinstance(block, dict) and block.get("cache_control") is not None
    }
    automatic = body.get("cache_control")
    cacheable = [
        index
        for index, block in enumerate(blocks)
        if not (isinstance(block, dict) and block.get("type") in ("thinking", "redacted_thinking"))
    ]
    if automatic is not None and cacheable:
        marks.setdefault(cacheable[-1], automatic.get("ttl", "5m"))
    return marks


def _prompt_blocks(body: dict[str, Any]) -> list[Any]:
    """The prompt in cache order: tools, system blocks, then every message's blocks."""
    system = body.get("system") or []
    blocks = list(body.get("tools") or []) + (
        [{"type": "text", "text": system}] if isinstance(system, str) else list(system)
    )
    for message in body["messages"]:
        content = message["content"]
        blocks += [{"type": "text", "text": content}] if isinstance(content, str) else content
    return blocks
