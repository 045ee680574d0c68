"""OpenAI batch lines: every body field is honoured or refused with the line and the field named;
nothing that changes the answer is ignored."""

from __future__ import annotations

from typing import Any

import pytest

from prefixq.core import wire
from prefixq.core.entries import Entry, split_prefix, to_wire
from prefixq.core.errors import ValidationError
from prefixq.core.inputs import normalize
from prefixq.core.records import Request
from prefixq.core.settings import Settings

MSGS = [{"role": "user", "content": "hi"}]


def chat(**body: Any) -> dict[str, Any]:
    return {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": MSGS, **body},
    }


def completion(**body: Any) -> dict[str, Any]:
    return {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "Once", **body},
    }


def parse(line: dict[str, Any], index: int = 0) -> Request:
    return Request.from_json(line, index=index)


def refused(line: dict[str, Any], match: str, index: int = 0) -> None:
    with pytest.raises(ValidationError, match=match):
        parse(line, index)


def test_sampling_fields_of_a_chat_body_reach_the_sampling_dict() -> None:
    """n, seed, stop, temperature, top_p, penalties, logit_bias and max_completion_tokens are
    honoured; the endpoint and the body's model are kept for the output objects."""
    req = parse(
        chat(
            model="gpt-4o-mini",
            n=3,
            seed=7,
            stop=["\n"],
            temperature=1.0,
            top_p=0.9,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logit_bias={"50": -100, "7": 5},
            max_completion_tokens=12,
        )
    )
    assert req.sampling == {
        "n": 3,
        "seed": 7,
        "stop": ["\n"],
        "temperature": 1.0,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"50": -100, "7": 5},
        "max_tokens": 12,
    }
    assert (req.endpoint, req.model, req.messages) == ("/v1/chat/completions", "gpt-4o-mini", MSGS)


def test_chat_logprobs_become_a_count_of_alternatives() -> None:
    """logprobs=true with top_logprobs=k asks for k alternatives; logprobs=true alone for 0;
    logprobs=false for none."""
    assert parse(chat(logprobs=True, top_logprobs=2)).sampling == {"logprobs": 2}
    assert parse(chat(logprobs=True)).sampling == {"logprobs": 0}
    assert parse(chat(logprobs=False)).sampling == {}
    refused(chat(top_logprobs=2), r"line 1: body.top_logprobs needs body.logprobs=true")
    refused(chat(logprobs=True, top_logprobs=21), "body.top_logprobs=21 must be between 0 and 20")
    refused(chat(logprobs=True, top_logprobs=-1), "body.top_logprobs=-1 must be between 0 and 20")
    refused(chat(logprobs=3), "body.logprobs must be true or false")


def test_completions_logprobs_prompt_forms_and_best_of() -> None:
    """Completions take an integer logprobs; a prompt as text, token ids or a list of one of
    those; best_of only when it equals n."""
    assert parse(completion(logprobs=3)).sampling == {"logprobs": 3}
    assert parse(completion(prompt=["One"])).prompt == "One"
    assert parse(completion(prompt=[1, 2, 3])).prompt_token_ids == [1, 2, 3]
    assert parse(completion(prompt=[[4, 5]])).prompt_token_ids == [4, 5]
    assert parse(completion(n=2, best_of=2)).sampling == {"n": 2}
    refused(completion(prompt=["a", "b"]), "several prompts: give one prompt per line")
    refused(completion(best_of=3), r"body.best_of=3 is refused")
    refused(completion(prompt={"x": 1}), "body.prompt must be a string or a list of token ids")


def test_response_formats() -> None:
    """text is the default (dropped); json_object and json_schema go to the engine as given;
    anything else is refused."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert parse(chat(response_format={"type": "text"})).sampling == {}
    assert parse(chat(response_format={"type": "json_object"})).sampling == {
        "response_format": {"type": "json_object"}
    }
    assert parse(completion(response_format=rf)).sampling == {"response_format": rf}
    refused(chat(response_format={"type": "xml"}), "response_format type 'xml' is not supported")
    refused(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "json_schema needs a 'schema' object",
    )
    refused(
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}),
        "json_schema has unknown fields: x",
    )
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(25):
        deep = {"type": "object", "properties": {"a": deep}}
    refused(
        chat(response_format={"type": "json_schema", "json_schema": {"schema": deep}}),
        "nests deeper than 14",
    )


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("stream", True, "not streamed"),
        ("stream_options", {"include_usage": True}, "not streamed"),
        ("tools", [{"type": "function", "function": {"name": "f"}}], "tool calling"),
        ("tool_choice", "required", "tool calling"),
        ("functions", [{"name": "f"}], "function calling"),
        ("function_call", {"name": "f"}, "function calling"),
        ("audio", {"voice": "alloy", "format": "wav"}, "audio"),
        ("modalities", ["text", "audio"], "only text"),
        ("prediction", {"type": "content", "content": "x"}, "predicted outputs"),
        ("web_search_options", {}, "web search"),
        ("reasoning_effort", "high", "reasoning effort"),
        ("verbosity", "low", "verbosity"),
    ],
)
def test_chat_fields_that_would_change_the_answer_are_refused(
    field: str, value: Any, why: str
) -> None:
    """Each refusal names the line, the field and why."""
    refused(chat(**{field: value}), rf"line 3: body\.{field}=.* is refused: .*{why}", index=2)


@pytest.mark.parametrize(("field", "value"), [("suffix", "end"), ("echo", True), ("stream", True)])
def test_completions_fields_that_would_change_the_answer_are_refused(
    field: str, value: Any
) -> None:
    refused(completion(**{field: value}), rf"line 1: body\.{field}=.* is refused")


def test_fields_that_cannot_change_the_answer_are_accepted() -> None:
    """user, metadata, store, service_tier and no-op values of refused fields pass; null means
    the default."""
    req = parse(
        chat(
            user="u",
            metadata={"k": "v"},
            store=False,
            service_tier="auto",
            prompt_cache_key="p",
            safety_identifier="s",
            stream=False,
            tools=[],
            tool_choice="none",
            parallel_tool_calls=True,
            modalities=["text"],
            stop=None,
            n=None,
            audio=None,
        )
    )
    assert req.sampling == {}
    assert parse(completion(echo=False, suffix=None)).sampling == {}


def test_method_and_url_are_checked() -> None:
    """method must be POST; missing method or url is refused (no default); a body must match
    its url."""
    line = chat()
    refused({**line, "method": "DELETE"}, "method must be POST, not 'DELETE'")
    refused({k: v for k, v in line.items() if k != "method"}, "needs 'method'")
    refused({k: v for k, v in line.items() if k != "url"}, "needs 'url'")
    refused({**line, "url": "/v1/moderations"}, "unsupported url '/v1/moderations'")
    refused({**line, "url": "/v1/completions"}, "body.messages does not go with the completions")
    refused({**completion(), "url": "/v1/chat/completions"}, "body.prompt does not go with")
    refused({**line, "extra": 1}, "unknown fields in an OpenAI batch line: extra")
    refused(chat(frobnicate=1), "unknown body fields: frobnicate")


def test_item_10_value_checks() -> None:
    """min_tokens over max_tokens (given or the default 256), negative stop_token_ids, an empty
    id, differing max_tokens/max_completion_tokens and a max_completion_tokens out of range are
    refused (naming that field, not the max_tokens it becomes)."""
    refused(chat(min_tokens=10, max_tokens=5), "min_tokens=10 is over max_tokens=5")
    refused(chat(min_tokens=300), r"min_tokens=300 is over max_tokens=256 \(the default\)")
    refused(chat(stop_token_ids=[2, -1]), "stop_token_ids must be a list of token ids")
    for line in ({**chat(), "custom_id": ""}, {"id": "", "prompt": "x"}):
        with pytest.raises(ValidationError, match=r"requests\[0\]: the id is empty"):
            normalize([line], Settings())
    refused(chat(max_tokens=5, max_completion_tokens=6), "max_completion_tokens differ")
    for bad in (0, -1, 1 << 21, 2.5, "8"):
        refused(chat(max_completion_tokens=bad), rf"body.max_completion_tokens={bad!r} must be")
    assert parse(chat(max_tokens=5, max_completion_tokens=5)).sampling == {"max_tokens": 5}


def test_logit_bias_is_checked_and_keyed_by_strings() -> None:
    """Keys must be token ids (ints from Python become strings, as JSON's are); biases lie in
    [-100, 100]."""
    plain = Request.from_json({"id": "a", "prompt": "x", "logit_bias": {5: 1.5}})
    assert plain.sampling == {"logit_bias": {"5": 1.5}}
    refused(chat(logit_bias={"abc": 1}), "logit_bias key 'abc' is not a token id")
    refused(chat(logit_bias={"5": 101}), "must be a number in")
    refused(chat(logit_bias={"-5": 1}), "is not a token id")


def test_plain_lines_take_the_same_fields() -> None:
    """n, logprobs, logit_bias and response_format on a plain line."""
    req = Request.from_json(
        {
            "id": "a",
            "prompt": "x",
            "n": 2,
            "logprobs": 1,
            "response_format": {"type": "json_object"},
        }
    )
    assert req.sampling == {"n": 2, "logprobs": 1, "response_format": {"type": "json_object"}}
    assert req.endpoint is None and req.model is None
    refused({"id": "a", "prompt": "x", "n": 0}, "n=0 must be between 1 and 128")
    refused({"id": "a", "prompt": "x", "logprobs": True}, "logprobs has the wrong type")


def test_the_endpoint_and_model_travel_in_the_entry() -> None:
    """Through the stream entry and back, the request keeps its url and model; an entry without
    them (a plain line, an older producer) has neither."""
    for line in (chat(model="m1"), {"id": "p", "prompt": "x"}):
        req = parse(line)
        prefix, own = split_prefix(req)
        d = to_wire(
            req,
            burst="b",
            index=0,
            shard=0,
            enqueued=1.0,
            work=1,
            predicted_cached=0,
            prefix=prefix,
            prefix_ref=None,
            own=own,
        )
        back = Entry.from_wire(wire.decode(wire.encode(d, "zlib"))).to_request(None)
        back.validate()
        assert (back.endpoint, back.model, back.sampling) == (req.endpoint, req.model, req.sampling)
