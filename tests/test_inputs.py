"""Bad input never crashes `prefixq submit` or the Python API:
invalid UTF-8, JSON too deep to read, lone surrogates, empty and duplicate ids each get a one-line
error naming the line (files) or the request (API), exit 1, and nothing is enqueued."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings

from helpers import cli
from prefixq.client import Producer
from prefixq.core.errors import ValidationError
from prefixq.core.inputs import read_requests
from prefixq.core.records import Request
from prefixq.core.settings import Settings

GOOD = b'{"id": "ok", "prompt": "hello"}\n'

BAD_LINES = [
    ("invalid-utf8", b'{"id": "a", "prompt": "caf\xe9"}\n', "line 2 is not valid UTF-8"),
    ("truncated-utf8", b'{"id": "a", "prompt": "\xe2\x82"}\n', "line 2 is not valid UTF-8"),
    ("deep-json", b"[" * 5000 + b"]" * 5000 + b"\n", "line 2 nests too deeply to read"),
    ("deep-object", b'{"a":' * 6000 + b"1" + b"}" * 6000 + b"\n", "line 2 nests too deeply"),
    (
        "huge-integer",
        b'{"id": ' + b"9" * 5000 + b', "prompt": "x"}\n',
        "line 2 holds a number of more",
    ),
    ("not-json", b"{'id': 'a'}\n", "line 2 is not JSON"),
    ("lone-surrogate", b'{"id": "a", "prompt": "x\\ud800y"}\n', "line 2: prompt holds a lone"),
    ("surrogate-id", b'{"id": "\\udfff", "prompt": "x"}\n', "line 2: id holds a lone surrogate"),
    (
        "surrogate-in-messages",
        b'{"id": "a", "messages": [{"role": "user", "content": "\\ud83d"}]}\n',
        "line 2: message 0 content holds a lone surrogate",
    ),
    (
        "surrogate-in-stop",
        b'{"id": "a", "prompt": "x", "stop": ["ok", "\\ud800"]}\n',
        "line 2: stop[1] holds a lone surrogate",
    ),
    (
        "surrogate-in-prefix",
        b'{"id": "a", "prefix": "doc\\udbff", "prompt": "x"}\n',
        "line 2: prefix holds a lone surrogate",
    ),
    (
        "deep-message-field",
        b'{"id": "a", "messages": [{"role": "user", "content": "x", "t": '
        + b"[" * 40
        + b"]" * 40
        + b"}]}\n",
        "line 2: message 0 t",
    ),
    ("int-beyond-64-bits", b'{"id": "a", "prompt": "x", "top_k": 1' + b"0" * 30 + b"}\n", "top_k"),
    ("empty-id", b'{"id": "", "prompt": "x"}\n', "line 2: the id is empty"),
]


def submit_file(tmp_path: Path, content: bytes) -> subprocess.CompletedProcess[str]:
    """``prefixq submit FILE`` with a Redis URL nothing listens on: input errors come first."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    return cli(None, "submit", str(src), url="redis://127.0.0.1:9/0", timeout=60)


@pytest.mark.parametrize(("line", "says"), [pytest.param(b, s, id=i) for i, b, s in BAD_LINES])
def test_submit_refuses_a_bad_line_with_its_number_and_no_traceback(
    tmp_path: Path, line: bytes, says: str
) -> None:
    """A bad second line makes `prefixq submit` exit 1 with one line naming the file, the line and
    the problem, before it connects to Redis."""
    p = submit_file(tmp_path, GOOD + line + GOOD.replace(b'"ok"', b'"ok2"'))
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"prefixq: error: {tmp_path / 'in.jsonl'}: line 2")
    assert says in p.stderr


def test_duplicate_ids_in_a_file_name_both_lines(tmp_path: Path) -> None:
    """Duplicate ids in a file name the 1-based numbers of both lines (blank lines counted)."""
    lines = [b'{"id": "q%d", "prompt": "x"}\n' % i for i in range(6)]
    lines[4] = b'{"id": "q1", "prompt": "again"}\n'
    p = submit_file(tmp_path, b"".join(lines[:3]) + b"\n" + b"".join(lines[3:]))
    assert p.returncode == 1
    assert "line 6 and line 2 both have id 'q1'" in p.stderr


def test_a_file_starting_with_a_byte_order_mark_is_read() -> None:
    """A UTF-8 byte order mark before the first line (as some editors write) is not an error."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        f.write(b"\xef\xbb\xbf" + GOOD)
        f.flush()
        assert [r.id for r in read_requests(f.name)] == ["ok"]


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        ({"id": "a", "prompt": "x\ud800"}, "prompt holds a lone surrogate"),
        ({"id": "a", "prompt": "x", "prefix": "doc\udc00"}, "prefix holds a lone surrogate"),
        ({"id": "\ud800", "prompt": "x"}, "id holds a lone surrogate"),
        (
            {"id": "a", "messages": [{"role": "user", "content": "\udfff"}]},
            "message 0 content holds",
        ),
        ({"id": "a", "prompt": "x", "stop": "\ud800"}, "stop holds a lone surrogate"),
        (Request(id="a", prompt="x", sampling={"stop": ["\ud800"]}), "stop[0] holds"),
        (Request(id="a", prompt="x", prefix="\ud800" * 5000), "prefix holds a lone surrogate"),
        ({"id": "", "prompt": "x"}, "requests[1]: the id is empty"),
    ],
    ids=["prompt", "prefix", "id", "message", "stop", "stop-list", "long-prefix", "empty-id"],
)
def test_python_api_refuses_bad_text_naming_the_request(
    settings: Settings, r: redis.Redis, request_: dict[str, Any] | Request, says: str
) -> None:
    """`Producer.submit` refuses a lone surrogate (any text field) or an empty id with a
    ValidationError naming the request, and enqueues nothing."""
    with pytest.raises(ValidationError, match=re.escape(says)):
        Producer(settings).submit([{"id": "fine", "prompt": "x"}, request_])
    assert r.xlen(settings.keys.stream(0)) == 0


def test_python_api_names_both_positions_of_a_duplicate_id(settings: Settings) -> None:
    """Duplicate ids through the API name both positions, ``requests[3] and requests[1]``."""
    reqs = [{"id": f"q{i}", "prompt": "x"} for i in range(5)]
    reqs[3]["id"] = "q1"
    with pytest.raises(ValidationError, match=r"requests\[3\] and requests\[1\] both have id 'q1'"):
        Producer(settings).submit(reqs)


def test_python_api_refusals_name_the_request_as_requests_i_and_stay_in_the_error_root(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """A bad field of item 7 of a Python list is refused as ``requests[7]`` (it said "line 8", a
    file's numbering); an integer id of 5,000 digits is "id longer than 512 characters" (it
    raised CPython's ValueError); burst metadata holding a lone surrogate, and a tokenizer
    setting naming no tokenizer folder, are PrefixqErrors saying so (they raised
    UnicodeEncodeError and transformers' OSError)."""
    from prefixq.core.errors import ConfigError, PrefixqError

    s = make_settings()
    reqs: list[dict[str, Any]] = [{"id": f"q{i}", "prompt": "x"} for i in range(10)]
    reqs[7]["temperature"] = -1
    with pytest.raises(ValidationError, match=re.escape("requests[7]: ")):
        Producer(s).submit(reqs)
    for k in (0, 6):  # in the head, and after it
        big = [{"id": f"q{i}", "prompt": "x"} for i in range(8)]
        big[k]["id"] = 10**5000
        with pytest.raises(ValidationError, match=re.escape(f"requests[{k}]: id longer than 512")):
            Producer(s).submit(big)
    with pytest.raises(ValidationError, match="metadata holds a lone surrogate"):
        Producer(s).submit([{"id": "a", "prompt": "x"}], metadata={"note": "caf\udce9"})
    for folder in ("/nonexistent/tokenizer", tempfile.mkdtemp()):
        with pytest.raises(ConfigError, match="is not a folder holding a tokenizer") as e:
            Producer(make_settings(tokenizer=folder)).submit([{"id": "a", "prompt": "x"}])
        assert isinstance(e.value, PrefixqError)


@pytest.mark.parametrize("sampling", [[], 0, False, ""])
def test_a_sampling_that_is_no_object_is_refused_even_when_falsy(sampling: Any) -> None:
    """``"sampling": []`` (or 0, false, "") was taken as no sampling at all, while ``"abc"`` was
    refused: every value that is not an object (or null) is refused the same way."""
    with pytest.raises(ValidationError, match="'sampling' must be an object"):
        Request.from_json({"id": "a", "prompt": "x", "sampling": sampling})
    assert Request.from_json({"id": "a", "prompt": "x", "sampling": None}).sampling == {}


def test_content_parts_are_joined_without_changing_the_callers_messages(
    settings: Settings,
) -> None:
    """A message whose content is text parts is joined for the request, but the caller's own
    dict (and list) keep the parts, also when the submit is then refused."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "user", "content": parts}]
    line = {"id": "q", "messages": msgs}
    req = Request.from_json(line)
    assert req.messages == [{"role": "user", "content": "a\nb"}]
    assert msgs == [{"role": "user", "content": parts}] and line["messages"] is msgs
    with pytest.raises(ValidationError):
        Producer(settings).submit([line, {"id": "q", "prompt": "dup"}])
    assert msgs[0]["content"] is parts


def test_a_shared_prefix_is_checked_once_not_once_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The surrogate search runs once over a long non-ASCII prefix shared (the same object) by a
    thousand requests."""
    from prefixq.core import checks as text_checks

    searched: list[int] = []
    real = text_checks._SURROGATE

    class Counting:
        def search(self, s: str) -> Any:
            searched.append(len(s))
            return real.search(s)

    monkeypatch.setattr(text_checks, "_SURROGATE", Counting())
    doc = "é" * 100_000
    for i in range(1000):
        Request(id=f"q{i}", prompt="?", prefix=doc).validate()
    assert searched.count(len(doc)) == 1


# ---- fuzzing: no line produces anything but requests or a ValidationError -------------------
_KEYS = ["id", "prompt", "prefix", "messages", "role", "content", "stop", "max_tokens", "top_k"]
_KEYS += ["custom_id", "body", "url", "method", "prompt_token_ids", "sampling", "seed", "x"]
_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats()
    | st.text()
    | st.sampled_from(["\ud800", "a\udfffb", "\ud83d\ude00", "", "user"])
)
_json = st.recursive(
    _leaf,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=3), kids, max_size=5)
    ),
    max_leaves=12,
)
_text = st.text(max_size=8) | st.sampled_from(["\ud800", "a\udfffb", "\ud83d\ude00", ""])
_int = st.integers(min_value=-2, max_value=1 << 70)
_sampling = {
    "stop": _text | st.lists(_text, max_size=3),
    "stop_token_ids": st.lists(_int, max_size=3),
    "max_tokens": _int,
    "min_tokens": _int,
    "top_k": _int,
    "seed": _int,
    "temperature": st.floats() | _int,
}
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "wizard"]), "content": _text},
    optional={"name": _json},
)
#: request-shaped objects (one of the three prompt forms), so that fuzzing reaches the checks
#: behind the shape checks and the producer behind them
_request = st.one_of(
    st.fixed_dictionaries({"id": _text, "prompt": _text}, optional={"prefix": _text, **_sampling}),
    st.fixed_dictionaries(
        {"id": _text, "messages": st.lists(_message, min_size=1, max_size=3)}, optional=_sampling
    ),
    st.fixed_dictionaries(
        {"id": _text | _int, "prompt_token_ids": st.lists(_int, min_size=1, max_size=3)},
        optional={"prefix": st.lists(_int, min_size=1, max_size=3), **_sampling},
    ),
)
_object = _request | _json


def _line(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=True).encode() + b"\n"


@hsettings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    lines=st.lists(st.binary(max_size=64) | _object.map(_line), min_size=1, max_size=4),
)
def test_fuzzed_lines_give_requests_or_a_validation_error(
    make_settings: Callable[..., Settings], lines: list[bytes]
) -> None:
    """Any bytes, and any JSON built from request-like keys and values (lone surrogates
    included), read and submitted, give a burst or a ValidationError: never another exception."""
    s = make_settings()
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        f.write(b"".join(x if x.endswith(b"\n") else x + b"\n" for x in lines))
        f.flush()
        with contextlib.suppress(ValidationError):
            Producer(s).submit(read_requests(f.name, s))


@hsettings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(reqs=st.lists(_object, min_size=1, max_size=4))
def test_fuzzed_python_objects_give_a_burst_or_a_validation_error(
    make_settings: Callable[..., Settings], reqs: list[Any]
) -> None:
    """Any request-like Python objects given to `Producer.submit` give a burst or a
    ValidationError: never another exception."""
    with contextlib.suppress(ValidationError):
        Producer(make_settings()).submit(reqs)


def test_a_sampling_field_given_twice_with_different_values_is_refused() -> None:
    """`{"sampling": {"temperature": 0.5}, "temperature": 0.7}`: the top level won silently;
    the same value twice is fine."""
    with pytest.raises(ValidationError, match="line 1: temperature given both at the top level"):
        Request.from_json(
            {"id": "a", "prompt": "x", "sampling": {"temperature": 0.5}, "temperature": 0.7}
        )
    same = Request.from_json(
        {"id": "a", "prompt": "x", "sampling": {"temperature": 0.5}, "temperature": 0.5}
    )
    assert same.sampling["temperature"] == 0.5


def test_a_shared_sampling_object_is_not_changed_by_the_requests_using_it() -> None:
    """Requests built from one shared `sampling` dict: a top-level field of one request was
    written into the shared dict, so the next request without it inherited it."""
    shared = {"temperature": 0.0}
    first = Request.from_json({"id": "a", "prompt": "x", "sampling": shared, "max_tokens": 5})
    second = Request.from_json({"id": "b", "prompt": "y", "sampling": shared}, index=1)
    assert shared == {"temperature": 0.0}
    assert first.sampling.get("max_tokens") == 5 and "max_tokens" not in second.sampling


def test_chat_content_given_as_text_parts_is_taken_and_other_parts_are_refused(
    tmp_path: Path,
) -> None:
    """A plain line and an OpenAI /v1/chat/completions line whose message content is a list of
    text parts (OpenAI's chat shape) are read, the parts joined by newlines; an image part is
    refused by its line, naming the part (before: 'content must be a string', for both)."""
    parts = [{"type": "text", "text": "Read this."}, {"type": "text", "text": "Then answer."}]
    lines = [
        {"id": "p", "messages": [{"role": "user", "content": parts}]},
        {
            "custom_id": "o",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": parts}]},
        },
    ]
    f = tmp_path / "parts.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = read_requests(str(f))
    joined = [{"role": "user", "content": "Read this.\nThen answer."}]
    assert [q.messages for q in got] == [joined, joined]
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    f.write_text(json.dumps({"id": "i", "messages": [{"role": "user", "content": [image]}]}) + "\n")
    with pytest.raises(ValidationError, match="line 1: message 0 content part 0 is 'image_url'"):
        read_requests(str(f))
