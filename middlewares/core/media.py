"""Images and PDFs inside a request: the types the upstream takes, and data URLs."""

from __future__ import annotations

import string

IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
PDF = "application/pdf"
# Anthropic's content blocks: those that carry an image or a PDF, and those no cache breakpoint may mark.
MEDIA_BLOCKS = ("image", "document")  # tuples: a block's "type" may be anything, unhashable too
THINKING_BLOCKS = ("thinking", "redacted_thinking")
# Standard base64, as data URLs carry it: these characters, then at most two "=".
_BASE64_ALPHABET = (string.ascii_letters + string.digits + "+/").encode()


def split_data_url(url: str) -> tuple[str, str] | None:
    """(media type, lowercased; base64 data) of a `data:<type>;base64,<data>` URL, or None for
    another shape. The data is not checked: `is_base64` does that where it is needed."""
    head, comma, data = url.partition(",")
    if not head.startswith("data:") or not comma or not head.endswith(";base64"):
        return None
    return head[5:-7].lower(), data


def is_base64(data: str) -> bool:
    """Standard base64, padded, checked without decoding it: decoding a large image would hold
    the event loop longer than reading its characters does."""
    if not data or len(data) % 4 or not data.isascii():
        return False
    padding = data.encode().translate(None, _BASE64_ALPHABET)  # every character outside it
    return padding in (b"", b"=", b"==") and data.endswith(padding.decode())
