"""The mock upstream's prompt cache, modelled on Anthropic's: a breakpoint (`cache_control`)
caches the prompt up to and including its block (tools, then system, then messages); a later
request reads the longest cached prefix found at a breakpoint or up to 20 blocks before one;
prefixes shorter than the minimum are never cached. Tokens are counted as 4 bytes of JSON.

It makes usage realistic (`cache_read_input_tokens`, `cache_creation_input_tokens`), and since
each mock is one deployment, a conversation that moves to another deployment loses its cache.
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
        """input_tokens, cache_read_input_tokens and cache_creation_input_tokens for `body`,
        remembering the prefixes its breakpoints cache."""
        blocks = _prompt_blocks(body)
        sizes, keys, marks = [], [], []
        size, digest = 0, hashlib.blake2b(digest_size=16)
        for index, block in enumerate(blocks):
            if isinstance(block, dict) and "cache_control" in block:
                marks.append(index)
                block = {k: v for k, v in block.items() if k != "cache_control"}
            encoded = orjson.dumps(block)
            size += len(encoded) // 4
            digest.update(encoded)
            sizes.append(size)
            keys.append(digest.copy().digest())
        read = 0
        for mark in marks:
            for index in range(mark, max(-1, mark - LOOKBACK), -1):
                if keys[index] in self._prefixes:
                    read = max(read, sizes[index])
                    break
        written = 0
        if marks and sizes[marks[-1]] >= self.min_tokens and keys[marks[-1]] not in self._prefixes:
            written = sizes[marks[-1]] - read
        self._prefixes.update(keys[mark] for mark in marks if sizes[mark] >= self.min_tokens)
        return {
            "input_tokens": max(1, size - read - written),
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": written,
        }


def _prompt_blocks(body: dict[str, Any]) -> list[Any]:
    """The prompt in cache order: tools, system blocks, then every message's blocks."""
    system = body.get("system") or []
    blocks = list(body.get("tools") or []) + ([{"type": "text", "text": system}] if isinstance(system, str) else list(system))
    for message in body["messages"]:
        content = message["content"]
        blocks += [{"type": "text", "text": content}] if isinstance(content, str) else content
    return blocks
