"""OpenAI Responses API request → Anthropic Messages request, and the ResponseTurn its reply needs.

`input` is a string or a list of items: messages, tool calls and their outputs, reasoning items.
`instructions`, then the system and developer messages in order, make the system prompt; the
other items become alternating turns, as the chat route's messages do (tool results that answer
one assistant turn travel together). A 400 names the field at fault by its path, in `param` too,
as OpenAI's Responses API does.

The chat translator's helpers (`middlewares.translator`) do what both translations share, so the
two routes rewrite names, merge turns and check schemas alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from middlewares.core.errors import GatewayError, invalid_request
from middlewares.core.media import IMAGE_TYPES, PDF, THINKING_BLOCKS
from middlewares.core.openai_shapes import (
    Turn,
    append_blocks,
    cached,
    call_arguments,
    check_closed_objects,
    data_url,
    effort_and_thinking,
    input_schema,
    nonblank_text,
    sampling,
    tool_result,
    upstream_identifier,
)
from middlewares.core.protocols import ModelSpec, StoredConversation
from middlewares.core.reasoning import EFFORTS
from middlewares.core.sizes import DEFAULT_MAX_TOKENS
from middlewares.responses.turn import CUSTOM_INPUT, ResponseTurn

__all__ = [
    "ENCRYPTED_REASONING",
    "Seal",
    "Unseal",
    "input_items",
    "keeps",
    "previous_response_id",
    "prompt_cache_key",
    "referenced_responses",
    "refused_field",
    "to_anthropic",
]

# Opens a reasoning item's encrypted_content: the thinking blocks it holds, or None when the
# gateway cannot open it (another key, altered, not the gateway's).
Unseal = Callable[[str], list[dict[str, Any]] | None]
Seal = Callable[[list[dict[str, Any]]], str]

ENCRYPTED_REASONING = "reasoning.encrypted_content"
# The `include` values the gateway takes: the sealed thinking, and the output text's extras,
# which it has none of to add.
INCLUDES = frozenset({ENCRYPTED_REASONING, "message.output_text.logprobs", "message.input_image.image_url"})
# Hosted tools a client may send by default and the gateway leaves out (dated variants such as
# web_search_preview_2025_03_11 too): Claude gets no such tool.
DROPPED_TOOLS = ("web_search", "web_search_preview", "tool_search")
# The settings a response object echoes, under their Responses names.
ECHOED = (
    "instructions",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_output_tokens",
    "max_tool_calls",
    "parallel_tool_calls",
    "reasoning",
    "text",
    "metadata",
    "store",
    "previous_response_id",
    "prompt_cache_key",
    "safety_identifier",
    "truncation",
    "user",
    "service_tier",
)
MAX_CACHE_KEY = 256
MAX_REFERENCED = 100  # stored responses one request's item references may name
_ITEM_TYPES = (
    "message, function_call, function_call_output, custom_tool_call, custom_tool_call_output, reasoning "
    "or item_reference"
)


def _bad(path: str, what: str) -> GatewayError:
    return invalid_request(f"{path}: {what}", path)


def refused_field(body: dict[str, Any]) -> GatewayError | None:
    """The 400 for the first field the gateway refuses (it would change the answer and nothing
    upstream does it), or None. Cheap: the responses_refusals stage runs it before admission."""
    if body.get("background") not in (None, False):
        return _bad("background", "background responses are not supported; send the request without it")
    for field, what in (
        ("conversation", "conversations are not supported; send the whole conversation in input"),
        ("prompt", "stored prompts are not supported; send the instructions and input themselves"),
    ):
        if body.get(field) is not None:
            return _bad(field, what)
    if body.get("truncation") not in (None, "disabled"):
        return _bad("truncation", 'only "disabled" is supported')
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            return _bad("include", "expected a list")
        for i, value in enumerate(include):
            if not isinstance(value, str) or value not in INCLUDES:
                return _bad(f"include[{i}]", f"{value!r} is not supported; use {ENCRYPTED_REASONING!r}")
    if body.get("n") not in (None, 1):
        return _bad("n", "only 1 response per request is supported")
    if body.get("top_logprobs") not in (None, 0):
        return _bad("top_logprobs", "log probabilities are not available")
    return None


def to_anthropic(
    body: dict[str, Any],
    model: ModelSpec,
    *,
    response_id: str,
    created_at: int,
    unseal: Unseal | None = None,
    seal: Seal | None = None,
    previous: StoredConversation | None = None,
    referenced: dict[str, StoredConversation] | None = None,
) -> tuple[dict[str, Any], ResponseTurn]:
    """The upstream request for `body`, a Responses API request, and what its reply needs.

    `unseal` opens the reasoning items a client sends back (None: the gateway opens none, and a
    turn that needs its thinking goes without); `seal` makes a reasoning item's
    encrypted_content, when the request's `include` asks for it. `previous` is the stored
    response `previous_response_id` names: its conversation comes before the input, and its
    system and developer messages after the request's `instructions` (its own are not carried
    over, as on OpenAI). `referenced` holds the stored responses, by id, that the input's
    item references point into (`referenced_responses`)."""
    refused = refused_field(body)
    if refused is not None:
        raise refused
    asked = body.get("model")
    turn = ResponseTurn(
        response_id=response_id,
        model=asked if isinstance(asked, str) else model.id,
        created_at=created_at,
        echo={field: body[field] for field in ECHOED if body.get(field) is not None},
    )
    request: dict[str, Any] = {"model": model.id, "max_tokens": _max_tokens(body, model)}
    tools = _Tools(turn)
    tools.add_all(body.get("tools"))
    system = _instructions(body.get("instructions"))
    instructed = len(system)
    earlier = _earlier_entries(previous, system)
    entries = earlier + _Input(tools, unseal, referenced or {}).read(body.get("input"), system)
    request["messages"] = turn.conversation = _turns(entries, thinking=True)
    turn.conversation_system = system[instructed:]
    if system:
        request["system"] = system
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "expected a boolean")
    if stream:
        request["stream"] = True
    if tools.definitions:
        request["tools"] = tools.definitions
        choice = tools.choice(body.get("tool_choice"), model)
        if body.get("parallel_tool_calls") is False and choice.get("type") != "none":
            choice = {"type": "auto", **choice, "disable_parallel_tool_use": True}
        if choice:
            request["tool_choice"] = choice
    forced = request.get("tool_choice", {}).get("type") in ("any", "tool")
    thinking = _reasoning(body.get("reasoning"), model, request, forced, request["messages"], turn)
    if not thinking:
        # Without thinking, thinking blocks sent back say nothing the model reads: leave them out.
        if any(block["type"] in THINKING_BLOCKS for _, blocks in entries for block in blocks):
            request["messages"] = _turns(entries, thinking=False)
        if model.sampling:
            sampling(body, request)
    _text_format(body.get("text"), request)
    include = body.get("include") or ()
    if ENCRYPTED_REASONING in include:
        turn.seal = seal
    return request, turn


def previous_response_id(body: dict[str, Any]) -> str | None:
    """The stored response the request continues, if it names one."""
    value = body.get("previous_response_id")
    if value is not None and (not isinstance(value, str) or not value):
        raise _bad("previous_response_id", "expected the id of a stored response")
    return value


def keeps(body: dict[str, Any]) -> bool:
    """Whether the response is to be kept: `store` is true unless the request says false, as on OpenAI."""
    value = body.get("store")
    if value is not None and not isinstance(value, bool):
        raise _bad("store", "expected a boolean")
    return value is not False


def input_items(body: dict[str, Any], response_id: str) -> list[dict[str, Any]]:
    """The request's input as the Responses items `input_items.list` gives back: a string is a
    user message, a message's string content an input_text (output_text) part, and an item
    without an id gets one, made from the response's and its place."""
    raw = body.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw if isinstance(raw, list) else []
    listed = []
    suffix = response_id.removeprefix("resp_")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
            item.setdefault("status", "completed")
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = f"{_INPUT_ID_PREFIXES.get(kind, 'item')}_{suffix}_in{i}"
        listed.append(item)
    return listed


_INPUT_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
}


def _earlier_entries(previous: StoredConversation | None, system: list[dict[str, Any]]) -> list[Entry]:
    """A stored conversation as entries, its system text added to `system`. Breakpoints a client
    put on its blocks are left out: the automatic ones are set again on each request, and old
    ones would add up past the upstream's limit of four."""
    if previous is None:
        return []
    kept = previous.system
    system.extend(nonblank_text(kept) if isinstance(kept, str) else (_uncached(block) for block in kept or ()))
    entries: list[Entry] = []
    for message in previous.messages:
        content = message.get("content")
        blocks = nonblank_text(content) if isinstance(content, str) else [_uncached(block) for block in content or ()]
        entries.append((message["role"], blocks))
    return entries


def referenced_responses(body: dict[str, Any]) -> list[str]:
    """The ids of the responses whose items the input refers to (`item_reference`), each once, in
    the order of the input: an item the gateway made names its response in its id. More than
    MAX_REFERENCED is a 400 (each is a lookup in the store)."""
    raw = body.get("input")
    if not isinstance(raw, list):
        return []
    named = dict.fromkeys(
        response_id
        for item in raw
        if isinstance(item, dict)
        and item.get("type") == "item_reference"
        and (response_id := _response_of(item.get("id"))) is not None
    )
    if len(named) > MAX_REFERENCED:
        raise _bad("input", f"item references name {len(named):,} responses; at most {MAX_REFERENCED} may be named")
    return list(named)


def _response_of(item_id: Any) -> str | None:
    """The response an item id of the gateway's names (`msg_<request id>_1`, `fc_<request id>_in3`)."""
    if not isinstance(item_id, str):
        return None
    request, _, place = item_id.partition("_")[2].rpartition("_")
    return "resp_" + request if request and place else None


def _stored_item(stored: StoredConversation, item_id: str) -> tuple[dict[str, Any], list[dict[str, Any]] | None] | None:
    """The item of a stored response's output or input with `item_id`, and for a reasoning item
    of its output the thinking blocks it stands for (the answer's run of them in its place)."""
    output = stored.response.get("output") or []
    for index, item in enumerate(output):
        if item.get("id") == item_id:
            if item.get("type") != "reasoning":
                return item, None
            ordinal = sum(1 for earlier in output[:index] if earlier.get("type") == "reasoning")
            runs = _thinking_runs(stored.messages[-1] if stored.messages else None)
            return item, runs[ordinal] if ordinal < len(runs) else []
    for item in stored.input_items:
        if item.get("id") == item_id and item.get("type") != "item_reference":
            return item, None
    return None


def _thinking_runs(answer: dict[str, Any] | None) -> list[list[dict[str, Any]]]:
    """The answer turn's thinking blocks, in the runs the reply made reasoning items of."""
    if answer is None or answer.get("role") != "assistant" or not isinstance(answer.get("content"), list):
        return []
    runs: list[list[dict[str, Any]]] = []
    open_run = False
    for block in answer["content"]:
        thinking = block.get("type") in THINKING_BLOCKS
        if thinking:
            if not open_run:
                runs.append([])
            runs[-1].append(block)
        open_run = thinking
    return runs


def _uncached(block: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in block.items() if name != "cache_control"}


def prompt_cache_key(body: dict[str, Any]) -> str | None:
    """The request's `prompt_cache_key`, which names its conversation (the translation drops it)."""
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or len(key) > MAX_CACHE_KEY):
        raise _bad("prompt_cache_key", f"expected a string of at most {MAX_CACHE_KEY} characters")
    return key or None


def _max_tokens(body: dict[str, Any], model: ModelSpec) -> int:
    value = body.get("max_output_tokens")
    if value is None:
        return min(DEFAULT_MAX_TOKENS, model.max_output_tokens)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad("max_output_tokens", "expected a positive integer")
    if value > model.max_output_tokens:
        raise _bad("max_output_tokens", f"at most {model.max_output_tokens} for this model")
    return value


def _instructions(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise _bad("instructions", "expected a string")
    return nonblank_text(value)


# --- input: items → (role, blocks) entries, then turns.

Entry = tuple[str, list[dict[str, Any]]]


class _Input:
    """Reads `input`'s items into entries of one role each, system text aside."""

    def __init__(self, tools: _Tools, unseal: Unseal | None, referenced: dict[str, StoredConversation]) -> None:
        self._tools, self._unseal, self._referenced = tools, unseal, referenced

    def read(self, raw: Any, system: list[dict[str, Any]]) -> list[Entry]:
        if isinstance(raw, str):
            raw = [{"role": "user", "content": raw}]
        if not isinstance(raw, list):
            raise _bad("input", "expected a string or a list of items")
        entries: list[Entry] = []
        for i, item in enumerate(raw):
            self._item(item, f"input[{i}]", system, entries)
        if not entries:
            raise _bad("input", "must contain at least one item that is not a system or developer message")
        return entries

    def _item(self, item: Any, path: str, system: list[dict[str, Any]], entries: list[Entry]) -> None:
        if not isinstance(item, dict):
            raise _bad(path, "expected an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role in ("system", "developer"):
                system.extend(self._content(item.get("content"), f"{path}.content", role))
                return
            if role not in ("user", "assistant"):
                raise _bad(f"{path}.role", "expected one of user, assistant, system, developer")
            entries.append((role, self._content(item.get("content"), f"{path}.content", role)))
        elif kind in ("function_call", "custom_tool_call"):
            entries.append(("assistant", [self._call(item, path, kind == "custom_tool_call")]))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            entries.append(("user", [self._result(item, path)]))
        elif kind == "reasoning":
            entries.append(("assistant", self._reasoning(item, path)))
        elif kind == "item_reference":
            self._reference(item, path, system, entries)
        else:
            raise _bad(f"{path}.type", f"expected {_ITEM_TYPES}, not {kind!r}")

    def _reference(self, item: dict[str, Any], path: str, system: list[dict[str, Any]], entries: list[Entry]) -> None:
        """The item an item_reference names, read as if it were sent: the gateway looks it up in
        the stored response its id names (the key's own, kept); a reasoning item brings the
        thinking blocks that response kept."""
        item_id = item.get("id")
        stored = self._referenced.get(_response_of(item_id) or "")
        # (A stored response is found only by a string id.)
        found = _stored_item(stored, item_id) if stored is not None and isinstance(item_id, str) else None
        if found is None:
            raise _bad(f"{path}.id", f"no stored response of this key has an item with id {item_id!r}")
        referenced, thinking = found
        if thinking is not None:
            entries.append(("assistant", [dict(block) for block in thinking]))
        else:
            self._item(referenced, path, system, entries)

    def _content(self, content: Any, path: str, role: str) -> list[dict[str, Any]]:
        if isinstance(content, str):
            return nonblank_text(content)
        if not isinstance(content, list):
            raise _bad(path, "expected a string or a list of content parts")
        blocks: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            part_path = f"{path}[{j}]"
            if not isinstance(part, dict):
                raise _bad(part_path, "expected an object")
            kind = part.get("type")
            if kind in ("input_text", "output_text", "text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise _bad(f"{part_path}.text", "expected a string")
                blocks.extend(cached(block, part, part_path, part_path) for block in nonblank_text(text))
            elif kind == "refusal" and role == "assistant":
                continue  # a past refusal says nothing the model needs
            elif kind in ("input_image", "input_file") and role == "user":
                block = _image(part, part_path) if kind == "input_image" else _document(part, part_path)
                blocks.append(cached(block, part, part_path, part_path))
            elif role in ("system", "developer") or role == "assistant":
                raise _bad(f"{part_path}.type", f"only text parts are allowed in {role} messages, not {kind!r}")
            else:
                raise _bad(f"{part_path}.type", f"expected input_text, input_image or input_file, not {kind!r}")
        return blocks

    def _call(self, item: dict[str, Any], path: str, custom: bool) -> dict[str, Any]:
        call_id = _non_empty(item.get("call_id"), f"{path}.call_id")
        namespace = item.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise _bad(f"{path}.namespace", "expected a string")
        name = self._tools.upstream_name(_non_empty(item.get("name"), f"{path}.name"), namespace)
        if custom:
            value = item.get("input", "")
            if not isinstance(value, str):
                raise _bad(f"{path}.input", "expected a string")
            arguments: Any = {CUSTOM_INPUT: value}
        else:
            arguments = call_arguments(item.get("arguments", ""), f"{path}.arguments", f"{path}.arguments")
        return {"type": "tool_use", "id": upstream_identifier(call_id), "name": name, "input": arguments}

    def _result(self, item: dict[str, Any], path: str) -> dict[str, Any]:
        call_id = upstream_identifier(_non_empty(item.get("call_id"), f"{path}.call_id"))
        output = item.get("output", "")
        if isinstance(output, str):
            blocks = nonblank_text(output)
        elif isinstance(output, list):
            blocks = self._content(output, f"{path}.output", "user")
        else:
            raise _bad(f"{path}.output", "expected a string or a list of content parts")
        return tool_result(call_id, blocks)

    def _reasoning(self, item: dict[str, Any], path: str) -> list[dict[str, Any]]:
        """The thinking blocks a reasoning item sealed, in place; none when the gateway cannot
        open it (or it carries none): the turn then goes without its thinking."""
        sealed = item.get("encrypted_content")
        if sealed is not None and not isinstance(sealed, str):
            raise _bad(f"{path}.encrypted_content", "expected a string")
        if not sealed or self._unseal is None:
            return []
        blocks = self._unseal(sealed)
        return [dict(block) for block in blocks] if blocks else []


def _image(part: dict[str, Any], path: str) -> dict[str, Any]:
    if part.get("file_id") is not None:
        raise _bad(f"{path}.file_id", "files are not supported; send the image as image_url (a URL or a data URL)")
    url = part.get("image_url")
    where = f"{path}.image_url"
    if not isinstance(url, str):
        raise _bad(where, "expected an http(s) URL or a base64 data URL")
    if url.startswith(("http://", "https://")):
        # The images stage inlines these when it is mounted; without it the upstream fetches.
        return {"type": "image", "source": {"type": "url", "url": url}}
    media_type, data = data_url(url, where, where)
    if media_type not in IMAGE_TYPES:
        raise _bad(where, "the image type must be image/jpeg, image/png, image/gif or image/webp")
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def _document(part: dict[str, Any], path: str) -> dict[str, Any]:
    for field in ("file_id", "file_url"):
        if part.get(field) is not None:
            raise _bad(f"{path}.{field}", f"send the PDF as file_data (a base64 data URL); {field} is not supported")
    where = f"{path}.file_data"
    value = part.get("file_data")
    if not isinstance(value, str):
        raise _bad(where, "expected a base64 data URL (data:application/pdf;base64,<data>)")
    media_type, data = data_url(value, where, where)
    if media_type != PDF:
        raise _bad(where, "only PDF files (application/pdf) are supported")
    return {"type": "document", "source": {"type": "base64", "media_type": media_type, "data": data}}


def _non_empty(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(path, "expected a non-empty string")
    return value


def _turns(entries: list[Entry], *, thinking: bool) -> list[dict[str, Any]]:
    """Alternating turns: entries of one role in a row make one (a turn's thinking first, as the
    upstream wants it, and only with `thinking`)."""
    turns: list[Turn] = []
    for role, blocks in entries:
        if not thinking:
            blocks = [block for block in blocks if block["type"] not in THINKING_BLOCKS]
        append_blocks(turns, role, blocks)
    if not turns:
        raise _bad("input", "every item is empty")
    messages = []
    for role, results, others in turns:
        content = results + others
        if role == "assistant":  # thinking before what it led to, in its order
            content = [b for b in content if b["type"] in THINKING_BLOCKS] + [
                b for b in content if b["type"] not in THINKING_BLOCKS
            ]
        messages.append({"role": role, "content": content})
    return messages


# --- tools.


class _Tools:
    """The client's tools as Claude's: functions, custom (free-form) tools, and the tools of a
    namespace, flattened under names that say both; hosted search tools are left out."""

    def __init__(self, turn: ResponseTurn) -> None:
        self._turn = turn
        self.definitions: list[dict[str, Any]] = []
        self._custom: set[str] = set()
        self._paths: dict[str, str] = {}  # upstream name → where the tool was defined

    def add_all(self, tools: Any) -> None:
        if tools is None:
            return
        if not isinstance(tools, list):
            raise _bad("tools", "expected a list of tools")
        for i, tool in enumerate(tools):
            path = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise _bad(path, "expected an object")
            kind = tool.get("type")
            if kind == "namespace":
                namespace = _non_empty(tool.get("name"), f"{path}.name")
                inner = tool.get("tools")
                if not isinstance(inner, list):
                    raise _bad(f"{path}.tools", "expected a list of tools")
                for k, member in enumerate(inner):
                    self._add(member, f"{path}.tools[{k}]", namespace, tool.get("description"))
            elif isinstance(kind, str) and kind.startswith(DROPPED_TOOLS):
                continue
            else:
                self._add(tool, path, None, None)
        self._turn.custom_tools = frozenset(self._custom)

    def _add(self, tool: Any, path: str, namespace: str | None, about: Any) -> None:
        if not isinstance(tool, dict):
            raise _bad(path, "expected an object")
        kind = tool.get("type")
        if kind not in ("function", "custom"):
            what = "function or custom" if namespace else "function, custom and namespace"
            raise _bad(f"{path}.type", f"{kind!r} tools are not supported; only {what} tools are")
        name = _non_empty(tool.get("name"), f"{path}.name")
        upstream_name = self.upstream_name(name, namespace)
        if upstream_name in self._paths:
            raise _bad(f"{path}.name", f"the same name as {self._paths[upstream_name]}")
        self._paths[upstream_name] = path
        description = tool.get("description")
        description = description if isinstance(description, str) else ""
        if namespace and isinstance(about, str) and about:
            description = f"{description}\n\n(Part of {namespace}: {about})".strip()
        if kind == "function":
            schema = input_schema(tool.get("parameters"), f"{path}.parameters", f"{path}.parameters")
        else:
            schema = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}}, "required": [CUSTOM_INPUT]}
            description = _with_grammar(description, tool.get("format"), f"{path}.format")
            self._custom.add(upstream_name)
        definition: dict[str, Any] = {"name": upstream_name, "input_schema": schema}
        if description:
            definition["description"] = description
        if kind == "function" and tool.get("strict") is True:
            definition["strict"] = True
        self.definitions.append(cached(definition, tool, path, path))

    def upstream_name(self, name: str, namespace: str | None) -> str:
        """The name Claude knows a tool by (the same every time); the reply maps it back."""
        upstream_name = upstream_identifier(f"{namespace}__{name}" if namespace else name)
        if upstream_name != name:
            self._turn.renamed[upstream_name] = name
        if namespace:
            self._turn.namespaces[upstream_name] = namespace
        return upstream_name

    def choice(self, choice: Any, model: ModelSpec) -> dict[str, Any]:
        if choice is None or choice == "auto":
            return {"type": "auto"} if choice else {}
        if choice == "none":
            return {"type": "none"}
        if choice == "required":
            forced = {"type": "any"}
        elif isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
            kind, name, namespace = choice["type"], choice.get("name"), choice.get("namespace")
            # By the name the client gave it (a namespace's tool by its own name, the first if two share it).
            named = [
                upstream_name
                for upstream_name in self._paths
                if self._turn.renamed.get(upstream_name, upstream_name) == name
                and (upstream_name in self._custom) == (kind == "custom")
                and namespace in (None, self._turn.namespaces.get(upstream_name))
            ]
            if not named:
                raise _bad("tool_choice.name", f"expected the name of one of the {kind} tools")
            forced = {"type": "tool", "name": named[0]}
        else:
            raise _bad(
                "tool_choice",
                'expected "auto", "none", "required", {"type": "function", "name": …} or {"type": "custom", "name": …}',
            )
        if not model.forced_tool_choice:
            raise _bad("tool_choice", 'this model cannot be forced to call a tool; use "auto"')
        return forced


def _with_grammar(description: str, format: Any, path: str) -> str:
    """A custom tool's description, with the grammar its input must follow, if it has one."""
    if format is None or (isinstance(format, dict) and format.get("type") == "text"):
        return description
    if not isinstance(format, dict) or format.get("type") != "grammar":
        raise _bad(path, 'expected {"type": "text"} or {"type": "grammar", "syntax": …, "definition": …}')
    syntax, definition = format.get("syntax"), format.get("definition")
    if syntax not in ("lark", "regex") or not isinstance(definition, str):
        raise _bad(path, 'expected a grammar with a "syntax" of "lark" or "regex" and a "definition" string')
    rule = f"The `{CUSTOM_INPUT}` string must match this {syntax} grammar:\n{definition}"
    return f"{description}\n\n{rule}" if description else rule


# --- reasoning, output format.


def _reasoning(
    value: Any,
    model: ModelSpec,
    request: dict[str, Any],
    forced_tool: bool,
    messages: list[dict[str, Any]],
    turn: ResponseTurn,
) -> bool:
    """Effort and adaptive thinking from `reasoning.effort` (the chat route's table); True when
    thinking is requested."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise _bad("reasoning", "expected an object")
    summary = value.get("summary", value.get("generate_summary"))
    turn.summary = summary not in (None, "none")
    effort_name = value.get("effort")
    if effort_name is None:
        return False
    if not isinstance(effort_name, str) or effort_name not in EFFORTS:
        raise _bad("reasoning.effort", "use one of " + ", ".join(EFFORTS))
    return effort_and_thinking(effort_name, "reasoning.effort", model, request, forced_tool, messages)


def _text_format(value: Any, request: dict[str, Any]) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad("text", "expected an object")
    format = value.get("format")  # `verbosity` is ignored: Claude has no such setting
    if format is None:
        return
    kind = format.get("type") if isinstance(format, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        raise _bad(
            "text.format",
            'type "json_object" is not supported; use "json_schema" with a schema '
            '(objects need "additionalProperties": false)',
        )
    if kind != "json_schema":
        raise _bad("text.format.type", 'expected "json_schema" or "text"')
    schema = format.get("schema")
    if not isinstance(schema, dict):
        raise _bad("text.format.schema", "expected a JSON schema object")
    check_closed_objects(schema, "text.format.schema", "text.format.schema")
    request.setdefault("output_config", {})["format"] = {"type": "json_schema", "schema": schema}
