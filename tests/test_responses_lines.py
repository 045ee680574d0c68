"""`/v1/responses` batch lines: the body's translation into a chat request (messages, sampling,
what the Response object echoes), the per-line refusals, their trip through a stream entry and a
stored result, and the Response object of a result, checked with the `openai` client's own model.
The engine's side (a real batch on real workers): test_openai_responses.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import Response

from prefixq.core import wire
from prefixq.core.entries import Entry, to_wire
from prefixq.core.errors import ValidationError
from prefixq.core.records import Request, Result
from prefixq.core.settings import Settings
from prefixq.openai.formats import format_result
from prefixq.openai.validate import check_input


def line(cid: str = "r1", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": "smollm2", "input": "Hi there", **body},
    }


def test_string_input_and_instructions_become_a_system_and_a_user_message() -> None:
    req = Request.from_json(line(instructions="Be brief.", max_output_tokens=7, temperature=0))
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert req.sampling == {"max_tokens": 7, "temperature": 0}
    assert req.endpoint == "/v1/responses" and req.model == "smollm2"
    assert req.echo == {"instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0}


def test_message_items_with_text_parts_keep_their_roles_and_order() -> None:
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "c"}, {"type": "input_text", "text": "d"}],
        },
    ]
    req = Request.from_json(line(input=items))
    assert req.messages == [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "cd"},
    ]


def test_text_format_json_schema_is_structured_output() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    fmt = {"type": "json_schema", "name": "pt", "schema": schema, "strict": True}
    req = Request.from_json(line(text={"format": fmt}))
    assert req.sampling["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "pt", "schema": schema, "strict": True},
    }
    assert req.echo == {"text": {"format": fmt}}
    assert (
        "response_format" not in Request.from_json(line(text={"format": {"type": "text"}})).sampling
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"stream": True}, "stream"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_image",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input_file",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
            "function_call_output",
        ),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"input": None}, "input"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(
    change: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        Request.from_json(line(**change))


def test_fields_that_change_nothing_are_accepted() -> None:
    req = Request.from_json(
        line(
            store=True,
            user="u",
            tools=[],
            tool_choice="auto",
            background=False,
            parallel_tool_calls=True,
            truncation="disabled",
            service_tier="auto",
        )
    )
    assert req.sampling == {} and req.echo == {}


def test_input_check_refuses_bad_bodies_per_line_and_keeps_the_batch(tmp_path: Path) -> None:
    """Given a responses file whose line 2 asks for a tool, the check has no error: line 2 is a
    refused request (runs nothing), the others are requests, all in file order."""
    lines = [line("a"), line("b", tools=[{"type": "web_search"}]), line("c", input="x")]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    checked = check_input(path, "/v1/responses", Settings())
    assert checked.errors == []
    reqs = list(checked.requests)
    assert [r.id for r in reqs] == ["a", "b", "c"]
    assert reqs[0].refusal is None and reqs[2].refusal is None
    assert reqs[1].refusal is not None and "body.tools" in reqs[1].refusal
    # a broken line (not the body) still fails the batch, as for every endpoint
    path.write_text(json.dumps(line("a")) + "\nnot json\n")
    assert [e["code"] for e in check_input(path, "/v1/responses", Settings()).errors] == [
        "invalid_json_line"
    ]


def test_echo_and_refusal_travel_through_an_entry_and_a_stored_result() -> None:
    req = Request.from_json(line(instructions="Be brief.", metadata={"k": "v"}))
    refused = Request.refused("x", "body.tools is refused", endpoint="/v1/responses")
    for r in (req, refused):
        own = {"m": r.messages} if r.messages else {"p": r.prompt}
        d = to_wire(
            r,
            burst="b",
            index=0,
            shard=0,
            enqueued=1.0,
            work=1,
            predicted_cached=0,
            prefix=None,
            prefix_ref=None,
            own=own,
        )
        e = Entry.from_wire(wire.decode(wire.encode(d)))
        back = e.to_request(None)
        back.validate()
        assert (back.echo, back.refusal) == (r.echo, r.refusal)
        res = e.result(0, "w")
        assert Result.from_wire(res.to_wire()).echo == r.echo


def test_a_response_line_validates_as_the_clients_response() -> None:
    req = Request.from_json(line(instructions="Be brief.", metadata={"k": "v"}, top_p=0.5))
    res = Result(
        id="r1",
        index=0,
        text="Hello!",
        finish_reason="stop",
        prompt_tokens=20,
        cached_tokens=16,
        output_tokens=3,
        endpoint=req.endpoint,
        model="smollm2",
        echo=req.echo,
    )
    res.timings.enqueued = res.timings.admitted = 1_700_000_000.0
    res.timings.finished = 1_700_000_001.0
    ln = format_result(res, burst="batch_x")
    assert ln.ok and ln.obj["response"]["status_code"] == 200
    resp = Response.model_validate(ln.obj["response"]["body"])
    assert resp.object == "response" and resp.status == "completed"
    assert resp.output_text == "Hello!" and resp.model == "smollm2"
    assert resp.instructions == "Be brief." and resp.metadata == {"k": "v"} and resp.top_p == 0.5
    assert resp.usage is not None and resp.usage.input_tokens_details.cached_tokens == 16
    assert resp.usage.total_tokens == 23
    res.finish_reason = "length"
    cut = Response.model_validate(format_result(res, burst="batch_x").obj["response"]["body"])
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"


def test_only_a_responses_body_carries_an_echo() -> None:
    """An ``echo`` field in a plain line or a chat body is refused, not carried."""
    plain = {"id": "a", "prompt": "x", "echo": {"instructions": "y"}}
    chat = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "x"}], "echo": {"a": 1}},
    }
    for obj in (plain, chat):
        with pytest.raises(ValidationError, match="echo"):
            Request.from_json(obj)
