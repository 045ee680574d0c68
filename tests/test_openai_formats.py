"""OpenAI batch formats without a server: output lines, input checks, completion windows, keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types import Batch
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from prefixq.core.errors import ConfigError
from prefixq.core.records import Choice, Result, Timings, TokenLogprob
from prefixq.core.settings import Settings
from prefixq.openai.apierror import ApiError
from prefixq.openai.auth import KeyRing, is_loopback
from prefixq.openai.batches import batch_object, window_seconds
from prefixq.openai.formats import COMPLETIONS, format_result
from prefixq.openai.validate import MAX_ERRORS, check_input


def ok_result(index: int = 0, **kw: object) -> Result:
    base: dict[str, object] = {
        "id": f"c{index}",
        "index": index,
        "text": "Paris.",
        "finish_reason": "stop",
        "prompt_tokens": 11,
        "cached_tokens": 8,
        "output_tokens": 3,
        "timings": Timings(1.0, 2.0, 3.0, 1700000000.5),
    }
    return Result(**(base | kw))  # type: ignore[arg-type]


def test_chat_line_is_an_openai_chat_completion_with_usage_and_cached_tokens() -> None:
    """A successful result is a 200 line whose body validates as the client's ChatCompletion."""
    line = format_result(ok_result(), burst="b1", model="m")
    assert line.ok and line.kind == "completed"
    obj = json.loads(line.dumps())
    assert obj["custom_id"] == "c0" and obj["error"] is None
    assert obj["id"].startswith("batch_req_") and obj["response"]["request_id"].startswith("req_")
    assert obj["response"]["status_code"] == 200
    body = ChatCompletion.model_validate(obj["response"]["body"])
    assert body.object == "chat.completion" and body.model == "m" and body.created == 1700000000
    assert body.choices[0].message.content == "Paris." and body.choices[0].finish_reason == "stop"
    assert body.usage is not None and body.usage.total_tokens == 14
    assert body.usage.prompt_tokens_details is not None
    assert body.usage.prompt_tokens_details.cached_tokens == 8


def test_completions_line_is_an_openai_text_completion() -> None:
    line = format_result(ok_result(text=" Paris"), burst="b1", endpoint=COMPLETIONS, model="m")
    body = Completion.model_validate(json.loads(line.dumps())["response"]["body"])
    assert body.object == "text_completion" and body.choices[0].text == " Paris"
    assert body.id.startswith("cmpl-")


def test_line_ids_are_stable_per_burst_and_index() -> None:
    """Writing a burst's lines twice gives the same bytes; another burst or index other ids."""
    a = format_result(ok_result(), burst="b1").dumps()
    assert a == format_result(ok_result(), burst="b1").dumps()
    assert json.loads(a)["id"] != json.loads(format_result(ok_result(), burst="b2").dumps())["id"]
    assert json.loads(a)["id"] != json.loads(format_result(ok_result(1), burst="b1").dumps())["id"]


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("invalid_request", 400, "invalid_request_error"),
        ("engine_error", 500, "server_error"),
        ("dead_lettered", 500, "server_error"),
        ("internal_error", 500, "server_error"),
    ],
)
def test_failed_request_gets_an_http_error_response(code: str, status: int, kind: str) -> None:
    res = ok_result(error="the engine said no", error_code=code, text="")
    line = format_result(res, burst="b")
    assert line.kind == "failed" and not line.ok
    obj = json.loads(line.dumps())
    assert obj["error"] is None and obj["response"]["status_code"] == status
    err = obj["response"]["body"]["error"]
    assert err["type"] == kind and err["message"] == "the engine said no"
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("code", "oai"), [("expired", "batch_expired"), ("cancelled", "batch_cancelled")]
)
def test_requests_that_never_ran_get_batch_expired_or_cancelled(code: str, oai: str) -> None:
    res = ok_result(error=code, error_code=code, text="")
    obj = json.loads(format_result(res, burst="b").dumps())
    assert obj["response"] is None and obj["error"]["code"] == oai
    assert obj["error"]["message"]


def test_results_without_error_code_are_classified_from_the_message() -> None:
    dead = ok_result(error="dead-lettered: delivered 3 times", text="")
    assert json.loads(format_result(dead, burst="b").dumps())["response"]["status_code"] == 500


def test_batch_object_validates_as_the_clients_batch() -> None:
    m = {
        "id": "batch_1",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-1",
        "completion_window": "24h",
        "created_at": "1700000000.25",
        "expires_at": "1700086400.25",
        "status": "failed",
        "failed_at": "1700000001",
        "errors": json.dumps([{"code": "invalid_json_line", "message": "x", "line": 2}]),
        "metadata": json.dumps({"k": "v"}),
    }
    b = Batch.model_validate(batch_object(m))
    assert b.status == "failed" and b.created_at == 1700000000 and b.failed_at == 1700000001
    assert b.errors is not None and b.errors.data is not None and b.errors.data[0].line == 2
    assert b.metadata == {"k": "v"} and b.request_counts is not None
    assert b.request_counts.total == 0


@pytest.mark.parametrize(("w", "s"), [("24h", 86400), ("90s", 90), ("15m", 900), ("7d", 604800)])
def test_completion_windows(w: str, s: int) -> None:
    assert window_seconds(w) == s


@pytest.mark.parametrize("w", ["", "24", "0h", "h", "-1h", "1w", "31d", 24, None, "24 h"])
def test_bad_completion_windows_are_400s_naming_the_param(w: object) -> None:
    with pytest.raises(ApiError) as e:
        window_seconds(w)
    assert e.value.status == 400 and e.value.param == "completion_window"


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "in.jsonl"
    p.write_text("".join(x + "\n" for x in lines))
    return p


def _chat(cid: str, **over: object) -> str:
    line: dict[str, object] = {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    return json.dumps(line | over)


def test_input_check_reports_each_bad_line_with_its_number_and_code(tmp_path: Path) -> None:
    """Given one problem per line, each error names its 1-based line, code and param."""
    lines = [
        _chat("a"),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),
        _chat("b", url="/v1/completions"),
        _chat("a"),
        _chat("c", body={"model": "other", "messages": [{"role": "user", "content": "x"}]}),
        _chat("d", body={"model": "m", "messages": [{"role": "robot", "content": "x"}]}),
        _chat("e", method="GET"),
        "[1, 2]",
        "",
        _chat("f"),
        _chat("g", body={"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}),
        _chat(
            "h", body={"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        ),
    ]
    got = check_input(_write(tmp_path, lines), "/v1/chat/completions", Settings())
    assert len(got.requests) == 0
    assert [(e["line"], e["code"], e["param"]) for e in got.errors] == [
        (2, "invalid_json_line", None),
        (3, "missing_required_parameter", "custom_id"),
        (4, "url_mismatch", "url"),
        (5, "duplicate_custom_id", "custom_id"),
        (6, "model_mismatch", "body.model"),
        (7, "invalid_request", "body"),
        (8, "invalid_request", "method"),
        (9, "invalid_request", None),
        (12, "invalid_request", "body.n"),
        (13, "invalid_request", "body.stream"),
    ]
    assert "robot" in got.errors[5]["message"] and not got.errors[5]["message"].startswith("line")


def test_input_check_accepts_a_good_file_in_order(tmp_path: Path) -> None:
    got = check_input(
        _write(tmp_path, [_chat("x"), "", _chat("y")]), "/v1/chat/completions", Settings()
    )
    assert not got.errors and [r.id for r in got.requests] == ["x", "y"] and got.model == "m"


def test_empty_input_file_is_an_empty_file_error(tmp_path: Path) -> None:
    got = check_input(_write(tmp_path, ["", "  "]), "/v1/chat/completions", Settings())
    assert [e["code"] for e in got.errors] == ["empty_file"]


def test_input_check_skips_a_byte_order_mark_and_takes_crlf_lines(tmp_path: Path) -> None:
    """Given a file saved with a UTF-8 BOM and CRLF line ends (as Windows tools write it), every
    line is read, as `prefixq submit` reads the same file."""
    p = tmp_path / "in.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (_chat("x") + "\r\n" + _chat("y") + "\r\n").encode())
    got = check_input(p, "/v1/chat/completions", Settings())
    assert not got.errors and [r.id for r in got.requests] == ["x", "y"]


def test_submit_recognises_openai_lines_in_a_file_with_a_byte_order_mark(tmp_path: Path) -> None:
    """`prefixq submit` takes a file with a BOM (inputs.read_json_line); it must also see that the
    file holds OpenAI lines, or its results come out in prefixq's format."""
    from prefixq.openai.outputs import input_metadata

    p = tmp_path / "in.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (_chat("x") + "\n").encode())
    assert input_metadata(str(p)) == {
        "input_format": "openai",
        "endpoint": "/v1/chat/completions",
        "model": "m",
    }


def test_input_check_makes_unreadable_json_a_line_error_not_a_crash(tmp_path: Path) -> None:
    """Given JSON nested too deep to read, an integer of 5000 digits and bytes that are not UTF-8,
    each is an invalid_json_line error on its line (the check used to raise, and the batch stayed
    `validating` for ever, retried by every sweep)."""
    deep = '{"custom_id": "d", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    big = '{"custom_id": "b", "body": {"x": ' + "1" * 5000 + "}}"
    p = tmp_path / "in.jsonl"
    p.write_bytes("\n".join([_chat("a"), deep, big]).encode() + b"\n\xff\xfe\n")
    got = check_input(p, "/v1/chat/completions", Settings())
    assert [(e["line"], e["code"]) for e in got.errors] == [
        (2, "invalid_json_line"),
        (3, "invalid_json_line"),
        (4, "invalid_json_line"),
    ]


def test_input_check_refuses_what_the_producer_would_refuse_on_its_line(tmp_path: Path) -> None:
    """An empty custom_id, a lowercase method and a request over max_entry_bytes are errors of
    their lines (param named), not a batch error without a line from the submit."""
    huge = {"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]}
    lines = [_chat(""), _chat("a", method="post"), _chat("b", body=huge), _chat("c")]
    s = Settings(max_entry_bytes=1000, codec="none")
    got = check_input(_write(tmp_path, lines), "/v1/chat/completions", s)
    assert [(e["line"], e["code"], e["param"]) for e in got.errors] == [
        (1, "invalid_request", "custom_id"),
        (2, "invalid_request", "method"),
        (3, "invalid_request", "body"),
    ]
    assert "max_entry_bytes" in got.errors[2]["message"]


def test_input_check_lists_at_most_max_errors_but_counts_all(tmp_path: Path) -> None:
    got = check_input(_write(tmp_path, ["x"] * (MAX_ERRORS + 5)), "/v1/completions", Settings())
    assert len(got.errors) == MAX_ERRORS and got.error_count == MAX_ERRORS + 5


def test_keyring_parses_keys_and_namespaces(tmp_path: Path) -> None:
    ring = KeyRing.from_settings(Settings(api_keys="k1, k2=teamb", namespace="main"))
    assert ring.namespace_for("Bearer k1") == "main"
    assert ring.namespace_for("bearer k2") == "teamb"
    assert ring.namespaces == ["main", "teamb"]
    keyfile = tmp_path / "keys"
    keyfile.write_text("# comment\nk3=x\n\nk4\n")
    ring = KeyRing.from_settings(Settings(api_keys=f"@{keyfile}", namespace="n"))
    assert ring.keys == (("k3", "x"), ("k4", "n"))


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer wrong-key-123", "Basic k1"])
def test_keyring_refuses_missing_or_wrong_keys_with_401(header: str | None) -> None:
    ring = KeyRing.from_settings(Settings(api_keys="k1"))
    with pytest.raises(ApiError) as e:
        ring.namespace_for(header)
    assert e.value.status == 401
    assert "wrong-key-123" not in e.value.message  # the key is not echoed whole


@pytest.mark.parametrize("spec", ["k1,k1", "k1=bad ns", "k1={x}", "@/nonexistent/keys"])
def test_bad_api_keys_are_config_errors(spec: str) -> None:
    with pytest.raises(ConfigError):
        KeyRing.from_settings(Settings(api_keys=spec))


def test_open_keyring_lets_anyone_in_and_loopback_hosts_are_recognised() -> None:
    ring = KeyRing.from_settings(Settings(namespace="n"))
    assert ring.open and ring.namespace_for(None) == "n"
    assert all(
        map(
            is_loopback,
            ["127.0.0.1", "localhost", "LocalHost", "localhost.", "::1", "[::1]", "127.1.2.3"],
        )
    )
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.1", "example.com", "::"]))


def test_n_choices_and_logprobs_in_chat_and_completions_shapes() -> None:
    """All n choices are listed; logprobs take each endpoint's own OpenAI shape."""
    lp = [
        TokenLogprob(5, "Pa", -0.5, [(5, "Pa", -0.5), (9, "Lo", -1.5)]),
        TokenLogprob(6, None, -0.1),
    ]
    res = ok_result(
        choices=[
            Choice(0, "Paris.", [5, 6], "stop", lp),
            Choice(1, "Lyon", [7], "length", None),
        ],
        output_tokens=3,
    )
    chat = ChatCompletion.model_validate(
        json.loads(format_result(res, burst="b").dumps())["response"]["body"]
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[1].message.content == "Lyon" and chat.choices[1].finish_reason == "length"
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [t.token for t in content] == ["Pa", "token_id:6"]
    assert content[0].top_logprobs[1].token == "Lo" and content[0].bytes == list(b"Pa")
    assert chat.choices[1].logprobs is None
    text = Completion.model_validate(
        json.loads(format_result(res, burst="b", endpoint=COMPLETIONS).dumps())["response"]["body"]
    )
    tl = text.choices[0].logprobs
    assert tl is not None and tl.tokens == ["Pa", "token_id:6"] and tl.text_offset == [0, 2]
    assert tl.top_logprobs == [{"Pa": -0.5, "Lo": -1.5}, {}]


def test_a_results_own_endpoint_and_model_win_over_the_batchs() -> None:
    res = ok_result(endpoint=COMPLETIONS, model="own")
    body = json.loads(format_result(res, burst="b", model="batch").dumps())["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == "own"


def test_input_check_does_not_read_a_line_longer_than_any_request_whole(tmp_path: Path) -> None:
    """A line longer than any request this deployment takes (`line_limit`, as `prefixq submit`
    refuses it) is an error of its line, read past in chunks (a 150 MB line used to be held whole
    and parsed, ~490 MB), and the lines after it keep their numbers; also as the last line with no
    newline."""
    from prefixq.client.request_file import line_limit

    s = Settings(max_decoded_bytes=2000, max_prompt_chars=100)
    long = '{"custom_id": "z", "pad": "' + "x" * (3 * line_limit(s)) + '"}'
    p = _write(tmp_path, [_chat("a"), long, "{not json", _chat("b"), long])
    p.write_bytes(p.read_bytes().rstrip(b"\n"))
    got = check_input(p, "/v1/chat/completions", s)
    assert [(e["line"], e["code"]) for e in got.errors] == [
        (2, "line_too_long"),
        (3, "invalid_json_line"),
        (5, "line_too_long"),
    ]
    assert f"{line_limit(s):,} bytes" in got.errors[0]["message"]
    near = '{"custom_id": "n", "pad": "' + "x" * (line_limit(s) - 40) + '"}'
    got = check_input(_write(tmp_path, [_chat("a"), near]), "/v1/chat/completions", s)
    assert [e["code"] for e in got.errors] != ["line_too_long"]
