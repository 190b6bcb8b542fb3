"""Reasoning sealed into a reasoning item's encrypted_content (middlewares/responses/sealing.py):
real AES-GCM, through seal and open_sealed, each seal for one API key."""

from __future__ import annotations

import base64
import os

import orjson
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given
from hypothesis import strategies as st

from middlewares.responses.sealing import VERSION, associated_data, open_sealed, seal

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
KEY_ID = 7  # the API key answered with the sealed blocks
# As Claude sends them: a thinking block with its signature, a redacted one with its data.
BLOCKS = [
    {
        "type": "thinking",
        "thinking": "The user wants the weather: call get_weather. Ünïcödé ✓",
        "signature": "EqQBCkYIBxgCKkBz+/==",
    },
    {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"},
]


def test_sealed_blocks_open_exactly_as_claude_sent_them():
    sealed = seal(BLOCKS, KEY, KEY_ID)
    assert open_sealed(sealed, KEY, KEY_ID) == BLOCKS
    assert open_sealed(seal([], KEY, KEY_ID), KEY, KEY_ID) == []


def test_a_seal_is_compact_opaque_and_versioned():
    sealed = seal(BLOCKS, KEY, KEY_ID)
    assert sealed.startswith(VERSION)
    body = sealed.removeprefix(VERSION)
    assert set(body) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")  # base64url, no padding
    assert "get_weather" not in sealed and "EqQBCkYI" not in sealed  # nothing readable
    # The blocks' JSON, a nonce and a tag, in base64: no more.
    assert len(body) == -(-(len(orjson.dumps(BLOCKS)) + 12 + 16) * 4 // 3)


def test_each_seal_has_its_own_nonce():
    first, second = seal(BLOCKS, KEY, KEY_ID), seal(BLOCKS, KEY, KEY_ID)
    assert first != second
    assert open_sealed(first, KEY, KEY_ID) == open_sealed(second, KEY, KEY_ID) == BLOCKS


def test_another_key_opens_nothing():
    # Another gateway's, or the key before a rotation.
    assert open_sealed(seal(BLOCKS, KEY, KEY_ID), OTHER_KEY, KEY_ID) is None
    assert open_sealed(seal(BLOCKS, KEY, KEY_ID), b"short", KEY_ID) is None


def test_any_change_to_a_seal_opens_nothing():
    sealed = seal(BLOCKS, KEY, KEY_ID)
    body = sealed.removeprefix(VERSION)
    for position in range(0, len(body), 7):  # the nonce, the ciphertext and the tag
        swapped = "A" if body[position] != "A" else "B"
        assert open_sealed(VERSION + body[:position] + swapped + body[position + 1 :], KEY, KEY_ID) is None
    assert open_sealed(sealed[:-1], KEY, KEY_ID) is None  # cut short
    assert open_sealed(sealed[:-4], KEY, KEY_ID) is None
    assert open_sealed(sealed + "AAAA", KEY, KEY_ID) is None  # lengthened


def test_another_api_key_opens_nothing():
    # The id, not the secret: a rotated API key keeps its id, and opens what it was answered with.
    sealed = seal(BLOCKS, KEY, KEY_ID)
    assert open_sealed(sealed, KEY, KEY_ID + 1) is None
    assert open_sealed(sealed, KEY, 70) is None
    assert open_sealed(seal(BLOCKS, KEY, 70), KEY, KEY_ID) is None


def test_a_seal_of_another_version_or_purpose_opens_nothing():
    sealed = seal(BLOCKS, KEY, KEY_ID)
    assert open_sealed("ezat1." + sealed.removeprefix(VERSION), KEY, KEY_ID) is None  # bound to no key
    assert open_sealed(sealed.removeprefix(VERSION), KEY, KEY_ID) is None
    # The same key and format, made for something else: the associated data differs.
    nonce = os.urandom(12)
    elsewhere = AESGCM(KEY).encrypt(nonce, orjson.dumps(BLOCKS), b"something else for API key 7")
    assert open_sealed(VERSION + base64.urlsafe_b64encode(nonce + elsewhere).rstrip(b"=").decode(), KEY, KEY_ID) is None


def test_an_authentic_seal_of_anything_but_reasoning_blocks_opens_nothing():
    def sealed_as_ours(value) -> str:
        nonce = os.urandom(12)
        plain = orjson.dumps(value) if value is not None else b"not json"
        body = AESGCM(KEY).encrypt(nonce, plain, associated_data(KEY_ID))
        return VERSION + base64.urlsafe_b64encode(nonce + body).rstrip(b"=").decode()

    for value in (None, {"type": "thinking"}, [{"type": "text", "text": "hi"}], ["thinking"], [BLOCKS[0], 3]):
        assert open_sealed(sealed_as_ours(value), KEY, KEY_ID) is None
    assert open_sealed(sealed_as_ours(BLOCKS), KEY, KEY_ID) == BLOCKS


@pytest.mark.parametrize(
    "text",
    [
        "",
        "ezat2.",
        "ezat2.A",  # a length no base64 has
        "ezat2.AAAA",  # shorter than a nonce and a tag
        "ezat2." + "A" * 40,  # long enough, not a seal
        "ezat2.not base64!",
        "ezat2.abc+/def",  # standard base64's characters, not base64url's
        "ezat2.YWJj=",
        "gAAAAABnZ2xhc3M=",  # another gateway's format
        "ezat2.\u00e9\u00e9\u00e9\u00e9",
        None,
        42,
        ["ezat2.AAAA"],
        {"sealed": True},
    ],
)
def test_garbage_opens_to_none_never_an_exception(text):
    assert open_sealed(text, KEY, KEY_ID) is None


@given(st.text(max_size=200))
def test_no_string_makes_open_sealed_raise(text):
    assert open_sealed(text, KEY, KEY_ID) is None
    assert open_sealed(VERSION + text, KEY, KEY_ID) is None


def test_seal_takes_only_reasoning_blocks_and_a_32_byte_key():
    with pytest.raises(ValueError, match="thinking"):
        seal([{"type": "text", "text": "an answer"}], KEY, KEY_ID)
    with pytest.raises(ValueError, match="thinking"):
        seal(["thinking"], KEY, KEY_ID)
    with pytest.raises(ValueError, match="32 bytes"):
        seal(BLOCKS, KEY[:16], KEY_ID)
