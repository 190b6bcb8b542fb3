"""Images and PDFs inside a request: the types the upstream takes, and data URLs."""

from __future__ import annotations

import binascii

import pybase64

IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
PDF = "application/pdf"
# Anthropic's content blocks: those that carry an image or a PDF, and those no cache breakpoint may mark.
MEDIA_BLOCKS = ("image", "document")  # tuples: a block's "type" may be anything, unhashable too
THINKING_BLOCKS = ("thinking", "redacted_thinking")


def split_data_url(url: str) -> tuple[str, str] | None:
    """(media type, lowercased; base64 data) of a `data:<type>;base64,<data>` URL, or None for
    another shape. The data is not checked: `is_base64` does that where it is needed."""
    head, comma, data = url.partition(",")
    if not head.startswith("data:") or not comma or not head.endswith(";base64"):
        return None
    return head[5:-7].lower(), data


def is_base64(data: str) -> bool:
    """Standard base64, padded, as data URLs carry it: its alphabet, then at most two "=". Decoded
    to be checked (pybase64 decodes faster than Python reads the characters one by one)."""
    if not data or len(data) % 4 or not data.isascii():
        return False
    try:
        pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def b64encode_str(data: bytes) -> str:
    """`data` in standard base64, as a data URL or a base64 source carries it (pybase64: the
    standard library's encoder is the largest cost of a request with an image)."""
    return pybase64.b64encode(data).decode("ascii")
