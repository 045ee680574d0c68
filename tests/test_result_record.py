"""The Result record's wire form: error codes, n choices with logprobs, old results still decode."""

from __future__ import annotations

import json

from prefixq.core import wire
from prefixq.core.records import Choice, TokenLogprob
from prefixq.core.result_record import ERROR_CODES, Result, Timings


def _logprobs() -> list[TokenLogprob]:
    return [
        TokenLogprob(9, "Hi", -0.25, [(9, "Hi", -0.25), (4, "Hello", -1.5)]),
        TokenLogprob(2, None, -9999.0, [(7, "!", -0.1)]),
    ]


def _full() -> Result:
    return Result(
        id="q1",
        index=3,
        text="Hi",
        finish_reason="length",
        token_ids=[9, 2],
        output_tokens=5,
        timings=Timings(1.0, 2.0, 3.0, 4.0),
        worker="w",
        choices=[
            Choice(0, "Hi", [9, 2], "length", _logprobs()),
            Choice(1, "Yo!", [5, 6, 7], "stop", []),
        ],
        endpoint="/v1/chat/completions",
        model="gpt-x",
    )


def test_a_result_with_choices_and_logprobs_survives_the_wire() -> None:
    """Every choice, each token's logprob and its alternatives come back as they were written."""
    res = _full()
    back = Result.from_wire(wire.decode(wire.encode(res.to_wire(), "zlib")))
    assert back == res


def test_choice_zero_is_not_stored_twice() -> None:
    """Choice 0 mirrors text and token ids; the wire holds them once."""
    d = _full().to_wire()
    assert d["ch"][0][1] is None and d["ch"][0][2] is None
    assert d["ch"][1][1] == "Yo!"


def test_error_codes_round_trip_and_old_results_decode() -> None:
    """A failed result keeps its code; a result written before the new keys decodes with their
    defaults (no code, no choices, no endpoint or model)."""
    for code in ERROR_CODES:
        res = Result(id="a", index=0, error="x", error_code=code)
        assert Result.from_wire(wire.decode(wire.encode(res.to_wire(), "none"))) == res
    old = Result(id="a", index=0, text="t").to_wire()
    assert not {"ec", "ch", "u", "md"} & old.keys()  # the pre-existing form, byte for byte
    back = Result.from_wire(old)
    assert (back.error_code, back.choices, back.endpoint, back.model) == (None, [], None, None)


def test_the_json_line_carries_the_code_and_choices_only_when_asked_for() -> None:
    """``error_code`` is always in the line; ``choices`` only when the request had n > 1 or
    logprobs; the line is plain JSON (no infinities)."""
    plain = Result(id="a", index=0, text="t").to_json()
    assert plain["error_code"] is None and "choices" not in plain
    line = _full().to_json(token_ids=True)
    assert [c["index"] for c in line["choices"]] == [0, 1]
    assert line["choices"][0]["logprobs"][0] == {
        "token_id": 9,
        "token": "Hi",
        "logprob": -0.25,
        "top_logprobs": [
            {"token_id": 9, "token": "Hi", "logprob": -0.25},
            {"token_id": 4, "token": "Hello", "logprob": -1.5},
        ],
    }
    assert line["choices"][1]["token_ids"] == [5, 6, 7]
    json.loads(json.dumps(line, allow_nan=False))
