"""Anthropic stream events → the Responses API's event stream (`event: <type>` and `data:` SSE).

Every event carries its `type` and a `sequence_number` counting from 0: response.created and
response.in_progress first, then each output item's events (output_item.added, its parts and
deltas, output_item.done), and last response.completed or response.incomplete with the whole
response, or response.failed. An item stays open until the next item starts or the message ends,
so a consecutive run of text (or thinking) blocks is one item, and the last item can say whether
the output limit cut it short. The items sent as done are the last event's output, made by the
builders a whole reply uses (reply.py).

Deltas are written from a head made once per item and constant parts, so a delta costs one
string encode; the deltas of one batch leave as one event.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any, cast

import orjson

from middlewares.core.errors import stream_error
from middlewares.core.reply import PING, Batch
from middlewares.core.usage import StreamUsage
from middlewares.responses.reply import (
    MESSAGE,
    REASONING,
    THINKING_BLOCKS,
    incomplete_reason,
    item_id,
    message_item,
    output_text,
    reasoning_item,
    response_object,
    tool_call_item,
)
from middlewares.responses.turn import CUSTOM_INPUT, ResponseTurn


@cache
def _head(kind: str) -> bytes:
    """An event's bytes up to its sequence number's value (made once a type)."""
    return b"event: " + kind.encode() + b'\ndata: {"type":"' + kind.encode() + b'","sequence_number":'


TEXT_DELTA = _head("response.output_text.delta")
ARGUMENTS_DELTA = _head("response.function_call_arguments.delta")

# An upstream error type → the Responses error code that says it (the codes OpenAI defines).
_ERROR_CODES = {"rate_limit_error": "rate_limit_exceeded"}


class _Item:
    """The output item being streamed: a message, a reasoning item, or a tool call."""

    __slots__ = (
        "kind",
        "index",
        "id",
        "pieces",
        "blocks",
        "call",
        "custom",
        "summary",
        "summaries",
        "delta_head",
        "delta_at",
        "delta_tail",
    )

    def __init__(self, kind: str, index: int, id: str) -> None:
        self.kind, self.index, self.id = kind, index, id
        self.pieces: list[str] = []  # a message's text, a call's arguments, the open thinking block's text
        self.blocks: list[dict[str, Any]] = []  # a reasoning item's thinking blocks, as the upstream's
        self.call: dict[str, Any] = {}  # a tool call's tool_use block (id, name)
        self.custom: _StringValue | None = None  # a custom tool's call: its input, decoded as it comes
        self.summary: list[str] | None = None  # the open summary part's text (reasoning, asked a summary)
        self.summaries = 0  # summary parts so far
        self.delta_head = b""  # a delta event's bytes up to its sequence number's value
        self.delta_at = b""  # what follows that value, up to the delta's text: which item, where
        self.delta_tail = b"}\n\n"  # what follows the delta's text


class ResponsesEncoder:
    """The EventEncoder of a Responses stream: each batch of the upstream's events as the
    Responses events they make, in one write."""

    ping = PING

    def __init__(self, turn: ResponseTurn, usage: StreamUsage) -> None:
        self._turn = turn
        self._usage = usage  # the stream's meter: the last event's usage
        self._seq = 0
        self._started = False
        self._output: list[dict[str, Any]] = []  # the items done, in order
        self._closed: list[_Item] = []  # what they were made of
        self._item: _Item | None = None
        self._block: str | None = None  # the upstream block being read, as it feeds the item: text, thinking, tool
        self._reason: str | None = None  # why the response is incomplete (message_delta's stop_reason)
        self.finished = False  # the stream's end is encoded: nothing follows
        # Once it is: the response the last event holds (completed, incomplete or failed), for
        # whatever keeps the response (a store) without reading the stream again.
        self.response: dict[str, Any] | None = None

    def encode(self, batch: Batch) -> bytes:
        if self.finished:
            return b""
        out: list[bytes] = []
        if not self._started:
            self._begin(out)
        pieces: list[str] = []  # the current block's deltas of this batch, sent as one
        # A translated stream's events are all parsed: only the native route relays bytes.
        for event in cast(list[dict[str, Any]], batch):
            kind = event["type"]
            if kind == "content_block_delta":
                delta = event["delta"]
                field = _PIECES.get(delta.get("type"))
                if field is not None:
                    pieces.append(delta.get(field) or "")
                elif delta.get("type") == "signature_delta" and self._block == "thinking":
                    self._open_item().blocks[-1]["signature"] = delta.get("signature") or ""
                continue
            if pieces:
                self._flush(pieces, out)
            if kind == "content_block_start":
                self._start_block(event.get("content_block") or {}, out)
            elif kind == "content_block_stop":
                self._stop_block(out)
            elif kind == "message_delta":
                self._reason = incomplete_reason((event.get("delta") or {}).get("stop_reason"))
                self._close(out)
            elif kind == "message_stop":
                self._close(out)
                self._end(out)
                break
            elif kind == "ping":
                out.append(PING)
            elif kind == "error":
                self._fail(event, out)
                break
        if pieces:
            self._flush(pieces, out)
        return b"".join(out)

    def _flush(self, pieces: list[str], out: list[bytes]) -> None:
        piece = pieces[0] if len(pieces) == 1 else "".join(pieces)
        pieces.clear()
        if piece:
            self._piece(piece, out)

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        seq = self._seq
        self._seq += 1
        return _head(kind) + b"%d," % seq + orjson.dumps(fields)[1:] + b"\n\n"

    def _begin(self, out: list[bytes]) -> None:
        self._started = True
        response = orjson.dumps(response_object(self._turn, [], status="in_progress"))
        for kind in ("response.created", "response.in_progress"):
            out.append(_head(kind) + b'%d,"response":' % self._seq + response + b"}\n\n")
            self._seq += 1

    # --- the upstream's blocks

    def _start_block(self, block: dict[str, Any], out: list[bytes]) -> None:
        kind = block.get("type")
        item = self._item
        if kind == "text":
            if item is None or item.kind != "message":
                self._open_message(out)
            self._block = "text"
            if block.get("text"):
                self._piece(block["text"], out)
        elif kind in THINKING_BLOCKS:
            if item is None or item.kind != "reasoning":
                item = self._open_reasoning(out)
            if kind == "thinking":
                item.blocks.append({"type": "thinking", "thinking": "", "signature": block.get("signature") or ""})
                self._block = "thinking"
                if block.get("thinking"):
                    self._piece(block["thinking"], out)
            else:
                item.blocks.append(dict(block))  # redacted: arrives whole
                self._block = None
        elif kind == "tool_use":
            self._open_call(block, out)
            self._block = "tool"
        else:
            self._block = None  # a server tool's block is not the client's to see

    def _open_item(self) -> _Item:
        """The item the open block feeds: there is one whenever a block is open (`_block`)."""
        if self._item is None:
            raise RuntimeError("a block is read with no output item open")
        return self._item

    def _stop_block(self, out: list[bytes]) -> None:
        if self._block == "thinking":
            self._end_thinking(self._open_item())
            self._end_summary(out)
        self._block = None

    def _piece(self, piece: str, out: list[bytes]) -> None:
        """Text, thinking or a call's arguments that arrived for the open block (none for a block
        the encoder leaves out, a server tool's say, which may come before any item is open)."""
        block = self._block
        if block is None:
            return
        item = self._open_item()
        custom = item.custom if block == "tool" else None
        if block == "text" or (block == "tool" and custom is None):
            item.pieces.append(piece)
            seq = self._seq
            self._seq += 1
            out.append(item.delta_head + str(seq).encode() + item.delta_at + orjson.dumps(piece) + item.delta_tail)
        elif custom is not None:
            item.pieces.append(piece)
            text = custom.feed(piece)
            if text:
                where = {"item_id": item.id, "output_index": item.index, "delta": text}
                out.append(self._event("response.custom_tool_call_input.delta", where))
        elif block == "thinking":
            item.pieces.append(piece)
            if self._turn.summary:
                self._summary_delta(item, piece, out)

    # --- output items

    def _open(self, added: dict[str, Any], out: list[bytes]) -> _Item:
        """`added`: the item as it starts, at the next index (the open item closed before it)."""
        item = self._item = _Item(added["type"], len(self._output), added["id"])
        out.append(self._event("response.output_item.added", {"output_index": item.index, "item": added}))
        return item

    def _open_reasoning(self, out: list[bytes]) -> _Item:
        self._close(out)
        return self._open(
            {"id": item_id(self._turn, REASONING, len(self._output)), "type": "reasoning", "summary": []}, out
        )

    def _open_message(self, out: list[bytes]) -> None:
        self._close(out)
        added = {"id": item_id(self._turn, MESSAGE, len(self._output)), "type": "message", "status": "in_progress"}
        item = self._open({**added, "role": "assistant", "content": []}, out)
        location = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        out.append(self._event("response.content_part.added", {**location, "part": output_text("")}))
        item.delta_head, item.delta_at, item.delta_tail = TEXT_DELTA, _delta_at(location), b',"logprobs":[]}\n\n'

    def _open_call(self, block: dict[str, Any], out: list[bytes]) -> None:
        self._close(out)
        call = {"id": block.get("id") or "", "name": block.get("name") or ""}
        item = self._open(tool_call_item(self._turn, len(self._output), call, "", status="in_progress"), out)
        item.call = call
        if item.kind == "custom_tool_call":
            item.custom = _StringValue()
        item.delta_head, item.delta_at = ARGUMENTS_DELTA, _delta_at({"item_id": item.id, "output_index": item.index})

    def _close(self, out: list[bytes]) -> None:
        """The open item is done: its closing events, and it joins the output."""
        item = self._item
        if item is None:
            return
        self._item = None
        done = self._finished_item(item, "incomplete" if self._reason is not None else "completed", out)
        self._output.append(done)
        self._closed.append(item)
        out.append(self._event("response.output_item.done", {"output_index": item.index, "item": done}))

    def answer(self) -> list[dict[str, Any]]:
        """The upstream's content blocks the done items were made of (a run of text as one
        block, thinking with its signature), as its whole message would hold them: what a
        stored response keeps of its answer."""
        blocks: list[dict[str, Any]] = []
        for item in self._closed:
            if item.kind == "message":
                blocks.append({"type": "text", "text": "".join(item.pieces)})
            elif item.kind == "reasoning":
                blocks.extend(item.blocks)
            else:
                blocks.append({"type": "tool_use", **item.call, "input": _tool_input("".join(item.pieces))})
        return blocks

    def _finished_item(self, item: _Item, status: str, out: list[bytes] | None) -> dict[str, Any]:
        """The item as it ends, `status` if it has one; with `out`, the events that close its parts first."""
        location = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            text = "".join(item.pieces)
            if out is not None:
                where = {**location, "content_index": 0}
                out.append(self._event("response.output_text.done", {**where, "text": text, "logprobs": []}))
                out.append(self._event("response.content_part.done", {**where, "part": output_text(text)}))
            return message_item(self._turn, item.index, text, status)
        if item.kind == "reasoning":
            self._end_thinking(item)
            if out is not None:
                self._end_summary(out)
            return reasoning_item(self._turn, item.index, item.blocks)
        arguments = "".join(item.pieces) or "{}"
        done = tool_call_item(self._turn, item.index, item.call, arguments, status)
        if item.custom is not None:
            text, sent = done["input"], item.custom.sent
            if not text.startswith(sent):  # JSON cut short (the output limit): what was decoded
                text = done["input"] = sent
            if out is not None:
                rest = text[len(sent) :]
                if rest:  # what the deltas could not say as it came (JSON of another shape)
                    out.append(self._event("response.custom_tool_call_input.delta", {**location, "delta": rest}))
                out.append(self._event("response.custom_tool_call_input.done", {**location, "input": text}))
        elif out is not None:
            out.append(self._event("response.function_call_arguments.done", {**location, "arguments": arguments}))
        return done

    @staticmethod
    def _end_thinking(item: _Item) -> None:
        """The thinking block's text is whole: into the block, which is sealed as written."""
        if item.pieces:
            item.blocks[-1]["thinking"] += "".join(item.pieces)
            item.pieces.clear()

    # --- a reasoning item's summary: each thinking block's text, a part of its own

    def _summary_delta(self, item: _Item, piece: str, out: list[bytes]) -> None:
        location = {"item_id": item.id, "output_index": item.index, "summary_index": item.summaries}
        if item.summary is None:
            item.summary = []
            part = {"type": "summary_text", "text": ""}
            out.append(self._event("response.reasoning_summary_part.added", {**location, "part": part}))
        item.summary.append(piece)
        out.append(self._event("response.reasoning_summary_text.delta", {**location, "delta": piece}))

    def _end_summary(self, out: list[bytes]) -> None:
        item = self._item
        if item is None or item.summary is None:
            return
        text = "".join(item.summary)
        location = {"item_id": item.id, "output_index": item.index, "summary_index": item.summaries}
        out.append(self._event("response.reasoning_summary_text.done", {**location, "text": text}))
        part = {"type": "summary_text", "text": text}
        out.append(self._event("response.reasoning_summary_part.done", {**location, "part": part}))
        item.summary = None
        item.summaries += 1

    # --- the end

    def _end(self, out: list[bytes]) -> None:
        reason = self._reason
        status = "completed" if reason is None else "incomplete"
        response = response_object(self._turn, self._output, status=status, usage=self._usage.total(), reason=reason)
        out.append(self._event("response." + status, {"response": response}))
        self.response, self.finished = response, True

    def _fail(self, event: dict[str, Any], out: list[bytes]) -> None:
        """An error after the stream began: the response failed, with what it held so far."""
        error = stream_error(event)
        kind: Any = (event.get("error") or {}).get("type")  # the upstream's JSON, any value
        output = list(self._output)
        if self._item is not None:
            output.append(self._finished_item(self._item, "incomplete", None))  # cut short
        failed = {"code": _ERROR_CODES.get(kind, "server_error"), "message": error.message}
        response = response_object(self._turn, output, status="failed", error=failed)
        out.append(self._event("response.failed", {"response": response}))
        self.response, self.finished = response, True


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}  # cut short by the output limit
    return value if isinstance(value, dict) else {}


def _delta_at(location: dict[str, Any]) -> bytes:
    """A delta event's members between its sequence number and its text."""
    return b"," + orjson.dumps(location)[1:-1] + b',"delta":'


class _StringValue:
    """A custom tool's input, decoded as its JSON arrives: Claude writes `{"input": "..."}`, and
    each piece of the string that is whole (no escape cut in two) can go to the client at once.
    JSON of another shape is left to the end, decoded whole."""

    __slots__ = ("tail", "started", "ended", "sent")

    def __init__(self) -> None:
        self.tail = ""  # what has arrived and is not decoded yet
        self.started = self.ended = False  # the string's opening quote, its closing one, seen
        self.sent = ""  # the text decoded so far

    def feed(self, piece: str) -> str:
        """The text `piece` completes (or "")."""
        if self.ended:
            return ""
        tail = self.tail + piece
        if not self.started:
            opening = _OPENING.match(tail)
            if opening is None:
                # Not yet, or never: another shape is decoded at the end, whole.
                self.ended = len(tail) > _OPENING_AT_MOST
                self.tail = tail
                return ""
            tail, self.started = tail[opening.end() :], True
        whole = _whole_prefix(tail)
        if whole is None:  # no JSON string: decoded at the end
            self.ended = True
            return ""
        cut, self.ended = whole
        try:
            text: str = orjson.loads('"' + tail[:cut] + '"')  # a JSON string's contents
        except orjson.JSONDecodeError:
            self.ended = True
            return ""
        self.tail = tail[cut:]
        self.sent += text
        return text


_OPENING = re.compile(r'\s*\{\s*"' + CUSTOM_INPUT + r'"\s*:\s*"')
_OPENING_AT_MOST = 64  # more than any spacing of the opening; beyond it, another shape
_SPECIAL = re.compile(r'["\\]')


def _whole_prefix(text: str) -> tuple[int, bool] | None:
    """How much of `text`, a JSON string's contents, decodes now (up to an escape cut short, or
    its closing quote), and whether the string ends there; None if it is not a JSON string."""
    at = 0
    while True:
        found = _SPECIAL.search(text, at)
        if found is None:
            return len(text), False
        at = found.start()
        if text[at] == '"':
            return at, True
        if at + 1 >= len(text):
            return at, False
        if text[at + 1] != "u":
            at += 2
            continue
        if at + 6 > len(text):
            return at, False
        try:
            code = int(text[at + 2 : at + 6], 16)
        except ValueError:
            return None
        if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves, or neither yet
            if at + 12 > len(text):
                return at, False
            at += 12
        else:
            at += 6


# The deltas that carry what the model wrote (a signature is none of it) → the field that holds it.
_PIECES = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
