"""Reasoning sealed for the client to keep: an answer's thinking and redacted_thinking blocks, as
Claude sent them (each with its signature or data), as one opaque string, a reasoning item's
`encrypted_content`. When a later request sends the item back, the blocks go upstream again in
place, so thinking survives tool calls without the gateway keeping any state.

The blocks are encrypted and authenticated with AES-GCM under a key of the gateway's: the
client can neither read nor alter them, and a string sealed by another gateway (or under a
rotated key) does not open. Each seal is bound to the API key that was answered with it (its id,
which the key's rotation keeps): another key that sends it back cannot have the model read, or
repeat, thinking that was not its own. The format: VERSION, then base64url without padding of a
random 96-bit nonce followed by the ciphertext of the blocks' JSON (its tag at the end)."""

from __future__ import annotations

import base64
import binascii
import os
import re
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

# Another format gets another prefix; a string without this one is not opened. ezat1. seals
# were bound to no API key.
VERSION = "ezat2."
# Bound into every seal as associated data, with the API key's id: a ciphertext made under the
# same key for another purpose does not open as reasoning, nor reasoning as something else.
PURPOSE = b"ezat-gateway reasoning blocks v2"
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # GCM's 96-bit nonce, random per seal
TAG_BYTES = 16
SEALED_TYPES = frozenset({"thinking", "redacted_thinking"})
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")


def seal(blocks: list[dict[str, Any]], key: bytes, key_id: int) -> str:
    """The blocks as one opaque string, which opens only for the API key `key_id`; each must be
    a thinking or redacted_thinking block."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"the reasoning key must be {KEY_BYTES} bytes")
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") not in SEALED_TYPES:
            raise ValueError("only thinking and redacted_thinking blocks are sealed")
    return seal_bytes(orjson.dumps(blocks), key, associated_data(key_id), VERSION)


def open_sealed(text: object, key: bytes, key_id: int) -> list[dict[str, Any]] | None:
    """The blocks `seal` sealed in `text` for the API key `key_id`, or None for anything that
    does not open under `key` for it: another API key's, another gateway's or a rotated key's, a
    string altered or cut, another version, not base64, not a string at all. Never raises: what
    a client sends back is not trusted."""
    plain = open_bytes(text, key, associated_data(key_id), VERSION)
    if plain is None:
        return None
    try:
        blocks = orjson.loads(plain)
    except orjson.JSONDecodeError:
        return None
    # Authentic, so ours; checked all the same, since the caller puts these blocks upstream.
    if not isinstance(blocks, list) or not all(
        isinstance(block, dict) and block.get("type") in SEALED_TYPES for block in blocks
    ):
        return None
    return blocks


def seal_bytes(plain: bytes, key: bytes, bound_to: bytes, version: str) -> str:
    """`plain` encrypted and authenticated under `key` (AES-256-GCM), bound to `bound_to`: `version`,
    then base64url without padding of a random nonce and the ciphertext (its tag at the end)."""
    nonce = os.urandom(NONCE_BYTES)
    return version + base64.urlsafe_b64encode(nonce + AESGCM(key).encrypt(nonce, plain, bound_to)).rstrip(b"=").decode()


def open_bytes(text: object, key: bytes, bound_to: bytes, version: str) -> bytes | None:
    """What `seal_bytes` sealed in `text` under `key` for `bound_to`, or None for anything else
    (another key's or binding's, altered or cut, another version, not base64, not a string).
    Never raises."""
    if not isinstance(text, str) or not text.startswith(version) or len(key) != KEY_BYTES:
        return None
    encoded = text[len(version) :]
    if not _BASE64URL.fullmatch(encoded):
        return None
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except (binascii.Error, ValueError):  # a length no encoding has
        return None
    if len(raw) < NONCE_BYTES + TAG_BYTES:
        return None
    try:
        return AESGCM(key).decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], bound_to)
    except InvalidTag:
        return None


def associated_data(key_id: int) -> bytes:
    """What a seal is bound to besides its key: the purpose, and the API key answered with it."""
    return PURPOSE + b" for API key " + str(key_id).encode("ascii")
