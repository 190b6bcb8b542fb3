"""Anthropic stream events → OpenAI `chat.completion.chunk` SSE lines.

Chunks are built from a head made once per stream (id, model, created) and constant suffixes,
so a text delta costs one string encode; the text deltas of one batch leave as one chunk.
"""

from __future__ import annotations

from typing import Any, cast

import orjson

from middlewares.core.errors import stream_error
from middlewares.core.reply import PING, Batch
from middlewares.core.usage import StreamUsage
from middlewares.translator.response import finish_reason, openai_usage

DONE = b"data: [DONE]\n\n"
_CHOICE = b',"choices":[{"index":0,"delta":'


def _suffixes(usage_field: bytes) -> tuple[bytes, bytes, bytes]:
    """What follows a chunk's delta; a text chunk's text; a finishing chunk's delta (%s: the reason)."""
    suffix = b',"logprobs":null,"finish_reason":null}]' + usage_field + b"}\n\n"
    return suffix, b"}" + suffix, b',"logprobs":null,"finish_reason":"%s"}]' + usage_field + b"}\n\n"


# Made once for all streams, by whether their chunks carry "usage": a stream holds only what
# starts its chunks (id, model, created), a few hundred bytes less each.
_SUFFIXES = {False: _suffixes(b""), True: _suffixes(b',"usage":null')}


class ChunkEncoder:
    ping = PING

    def __init__(
        self,
        *,
        completion_id: str,
        model: str,
        created: int,
        include_usage: bool,
        renamed: dict[str, str],
        usage: StreamUsage,
    ) -> None:
        head = orjson.dumps(
            {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        )[:-1]
        self._head = b"data: " + head
        self._suffix, self._content_suffix, self._finish_suffix = _SUFFIXES[include_usage]
        self._content_prefix = self._head + _CHOICE + b'{"content":'  # a text chunk: these around its text
        self._include_usage = include_usage
        self._usage = usage  # the stream's meter: the usage chunk's figures
        self._tools: dict[int, list[Any]] = {}  # upstream block index → [tool call index, arguments seen]
        self._renamed = renamed  # tool names the upstream was sent → the client's
        self.finished = False  # the stream's end is encoded: nothing follows

    def encode(self, batch: Batch) -> bytes:
        if self.finished:
            return b""
        out: list[bytes] = []
        text: list[str] = []
        # A translated stream's events are all parsed: only the native route relays bytes.
        for event in cast(list[dict[str, Any]], batch):
            kind = event["type"]
            if kind == "content_block_delta":
                delta = event["delta"]
                dtype = delta.get("type")
                if dtype == "text_delta":
                    text.append(delta["text"])
                    continue
                if dtype == "input_json_delta":
                    tool = self._tools.get(event["index"])
                    if tool is not None and delta.get("partial_json"):
                        tool[1] = True
                        self._flush(out, text)
                        out.append(self._tool_arguments(tool[0], delta["partial_json"]))
                continue  # thinking is counted in the usage, and not the client's to see
            self._flush(out, text)
            if kind == "message_start":
                out.append(self._chunk(b'{"role":"assistant","content":""}'))
            elif kind == "content_block_start":
                self._start_block(event, out)
            elif kind == "content_block_stop":
                tool = self._tools.get(event["index"])
                if tool is not None and not tool[1]:
                    out.append(self._tool_arguments(tool[0], "{}"))  # a tool with no arguments
            elif kind == "message_delta":
                reason = finish_reason(event.get("delta", {}).get("stop_reason"))
                out.append(self._head + _CHOICE + b"{}" + self._finish_suffix % reason.encode())
            elif kind == "message_stop":
                if self._include_usage:
                    usage = openai_usage(self._usage.total())
                    out.append(self._head + b',"choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n")
                out.append(DONE)
                self.finished = True
                break
            elif kind == "ping":
                out.append(PING)
            elif kind == "error":
                out.append(b"data: " + orjson.dumps({"error": stream_error(event).payload()}) + b"\n\n" + DONE)
                self.finished = True
                break
        self._flush(out, text)
        return b"".join(out)

    def _start_block(self, event: dict[str, Any], out: list[bytes]) -> None:
        block = event["content_block"]
        kind = block.get("type")
        if kind == "tool_use":
            index = len(self._tools)
            self._tools[event["index"]] = [index, False]
            call = {
                "index": index,
                "id": block["id"],
                "type": "function",
                "function": {"name": self._renamed.get(block["name"], block["name"]), "arguments": ""},
            }
            out.append(self._chunk(b'{"tool_calls":[' + orjson.dumps(call) + b"]}"))
        elif kind == "text" and block.get("text"):
            out.append(self._content(block["text"]))

    def _flush(self, out: list[bytes], text: list[str]) -> None:
        if text:
            out.append(self._content("".join(text)))
            text.clear()

    def _content(self, text: str) -> bytes:
        return self._content_prefix + orjson.dumps(text) + self._content_suffix

    def _tool_arguments(self, index: int, arguments: str) -> bytes:
        return self._chunk(
            b'{"tool_calls":[{"index":%d,"function":{"arguments":' % index + orjson.dumps(arguments) + b"}}]}"
        )

    def _chunk(self, delta: bytes) -> bytes:
        return self._head + _CHOICE + delta + self._suffix
