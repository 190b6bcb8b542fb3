"""The gateway's event-stream decoder on payloads Bedrock may write otherwise than the mock:
more fields than `bytes`, an escaped slash in the base64; and base64 that is not."""

from __future__ import annotations

import base64

import orjson

from gateway.mock.bedrock import event_frame
from gateway.upstream.bedrock import EventStreamDecoder

CHUNK = {":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"}
EVENT = b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"??>"}}'
ENCODED = base64.b64encode(EVENT).decode()  # "??>" makes a "/" in it


def test_a_payload_with_more_fields_or_escapes_is_parsed():
    assert "/" in ENCODED
    payloads = [
        orjson.dumps({"bytes": ENCODED}),
        orjson.dumps({"bytes": ENCODED, "p": "abcdefghijklmnop"}),  # padding, as Bedrock adds to some streams
        b'{"bytes":"' + ENCODED.replace("/", "\\/").encode() + b'"}',
        b'{ "bytes" : "' + ENCODED.encode() + b'" }',
    ]
    decoder = EventStreamDecoder()
    out = decoder(b"".join(event_frame(CHUNK, payload) for payload in payloads))
    assert out == (b"event: content_block_delta\ndata: " + EVENT + b"\n\n") * len(payloads)


def test_base64_that_is_not_ends_the_stream():
    frame = event_frame(CHUNK, b'{"bytes":"not base64!"}')
    out = EventStreamDecoder()(event_frame(CHUNK, orjson.dumps({"bytes": ENCODED})) + frame)
    assert out.startswith(b"event: content_block_delta\n")
    assert out.endswith(b'"message":"The upstream sent a frame the gateway cannot read."}}\n\n')
