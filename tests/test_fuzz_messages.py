"""Property-based fuzzing of Anthropic's Messages API on the gateway (POST /v1/messages and
/v1/messages/count_tokens) with hypothesis, as tests/test_fuzz.py does for the OpenAI route.

Random bodies of Anthropic's field names with random values of random types (messages of random
roles and blocks, sources, tool results, cache marks, thinking, the gateway's own `models`), on
both routes, streamed and not, go to a real gateway in front of the mock upstream (test_fuzz.py's
servers, on their background loop). Whatever comes back must be a well-formed success (a message
named as asked, a stream ending in message_stop, or a count) or Anthropic's error envelope with
a 4xx status: never a 5xx, never another body.
"""

from __future__ import annotations

import json

from hypothesis import event, given, note
from hypothesis import strategies as st

from tests.support import KEY, MODEL
from tests.test_fuzz import FUZZ_SETTINGS, Answer, servers  # noqa: F401 (a fixture)

ATOMS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 10**20),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.sampled_from(
        [
            "text",
            "image",
            "document",
            "url",
            "base64",
            "ephemeral",
            "1h",
            "5m",
            "user",
            "assistant",
            "system",
            "tool_result",
            "tool_use",
            "thinking",
            "enabled",
            "adaptive",
        ]
    ),
)
VALUES = st.recursive(
    ATOMS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "text",
                    "source",
                    "url",
                    "content",
                    "cache_control",
                    "ttl",
                    "role",
                    "name",
                    "input_schema",
                    "budget_tokens",
                    "effort",
                    "id",
                    "input",
                    "tool_use_id",
                    "media_type",
                    "data",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)
SOURCES = st.one_of(
    VALUES,
    st.fixed_dictionaries(
        {
            "type": st.just("url"),
            "url": st.sampled_from(
                ["http://127.0.0.1:9/x.png", "https://127.0.0.1/x.pdf", "ftp://x/y", "data:image/png;base64,AAAA"]
            ),
        }
    ),
)
BLOCKS = st.one_of(
    VALUES,
    st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.one_of(st.text(max_size=20), VALUES)}, optional={"cache_control": VALUES}
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "document"]), "source": SOURCES}, optional={"cache_control": VALUES}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": st.just("t1"),
            "content": st.one_of(
                VALUES, st.lists(st.fixed_dictionaries({"type": st.just("image"), "source": SOURCES}), max_size=2)
            ),
        }
    ),
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["user", "assistant", "system"]), VALUES),
            "content": st.one_of(st.text(max_size=20), st.lists(BLOCKS, max_size=3), VALUES),
        }
    ),
    max_size=3,
)
# Near-valid bodies too, so that successes (and a stream's end) are checked, not only refusals.
TEXT = st.text(alphabet="abc xyz", min_size=1, max_size=30).filter(str.strip)
VALID = st.fixed_dictionaries(
    {
        "model": st.sampled_from([MODEL, "test/small"]),
        "max_tokens": st.integers(1, 4096),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.just("user"),
                    "content": st.one_of(
                        TEXT,
                        st.lists(
                            st.fixed_dictionaries(
                                {"type": st.just("text"), "text": TEXT},
                                optional={"cache_control": st.just({"type": "ephemeral"})},
                            ),
                            min_size=1,
                            max_size=2,
                        ),
                    ),
                }
            ),
            min_size=1,
            max_size=2,
        ),
    },
    optional={
        "stream": st.booleans(),
        "system": TEXT,
        "cache_control": st.just({"type": "ephemeral"}),
        "metadata": st.just({"user_id": "u"}),
        "models": st.just(["test/small"]),
    },
)
ANY = st.fixed_dictionaries(
    {
        "model": st.one_of(st.sampled_from([MODEL, MODEL, "test/small", "nope"]), VALUES),
        "messages": st.one_of(MESSAGES, MESSAGES, VALUES),
    },
    optional={
        "max_tokens": st.one_of(st.integers(0, 200_000), VALUES),
        "stream": st.one_of(st.booleans(), VALUES),
        "system": st.one_of(st.text(max_size=20), st.lists(BLOCKS, max_size=2), VALUES),
        "tools": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"name": st.just("f"), "input_schema": VALUES}, optional={"cache_control": VALUES}
                ),
                max_size=2,
            ),
            VALUES,
        ),
        "thinking": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["enabled", "adaptive", "disabled"])},
                optional={"budget_tokens": st.integers(0, 300_000)},
            ),
            VALUES,
        ),
        "cache_control": VALUES,
        "output_config": VALUES,
        "tool_choice": VALUES,
        "metadata": VALUES,
        "models": st.one_of(st.just(["test/small"]), VALUES),
        "stop_sequences": VALUES,
        "x_unknown": VALUES,
    },
)
BODIES = st.one_of(VALID, ANY)


def check_answer(answer: Answer, request: dict, path: str) -> None:
    if answer.status != 200:
        assert answer.content_type == "application/json"
        error = json.loads(answer.body)
        assert set(error) == {"type", "error", "request_id"} and error["type"] == "error", error
        assert isinstance(error["error"]["type"], str) and isinstance(error["error"]["message"], str), error
        event(f"{path}: {answer.status} {error['error']['type']}")
        return
    if path.endswith("count_tokens"):
        counted = json.loads(answer.body)
        assert set(counted) == {"input_tokens"} and counted["input_tokens"] >= 0
    elif request.get("stream") is True:
        assert answer.content_type == "text/event-stream"
        assert answer.body.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n'), answer.body[-300:]
    else:
        message = json.loads(answer.body)
        assert (message["type"], message["model"]) == ("message", request["model"])
    event(f"{path}: 200")


@FUZZ_SETTINGS
@given(
    body=BODIES,
    path=st.sampled_from(["/v1/messages", "/v1/messages", "/v1/messages/count_tokens"]),
    as_a_count=st.booleans(),
)
def test_fuzz_every_answer_is_well_formed(servers, body, path, as_a_count):
    if path.endswith("count_tokens") and as_a_count:  # what a count takes
        body = {name: value for name, value in body.items() if name not in ("max_tokens", "stream")}
    raw = json.dumps(body).encode()
    note(f"sent to {path}: {raw[:3000]!r}")
    answer = servers.post(raw, {"x-api-key": KEY, "anthropic-version": "2023-06-01"}, path=path)
    note(f"got: HTTP {answer.status} {answer.body[:2000]!r}")
    assert answer.status < 500, f"HTTP {answer.status}: {answer.body[:500]!r}"
    check_answer(answer, body, path)
