"""A ``/v1/responses`` result as OpenAI's Response object (`response_body`), the body of its
batch output line.

One ``message`` output item with one ``output_text`` part; ``status`` ``completed``, or
``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` when the engine stopped at
the token limit; ``usage`` with ``input_tokens_details.cached_tokens`` (the prompt tokens vLLM
served from its prefix cache); the request's ``instructions``, ``metadata``, ``temperature``,
``top_p``, ``max_output_tokens`` and ``text`` repeated from its body (`Result.echo`), with OpenAI's
defaults where the body had none. Ids derive from the burst id and the input index, as every
output line's do. docs/openai.md, "/v1/responses", has the shape.
"""

from __future__ import annotations

import hashlib
from typing import Any

from prefixq.core.records import Result

__all__ = ["response_body"]


def _uid(prefix: str, burst: str, index: int) -> str:
    """A stable id for (burst, index), as `prefixq.openai.formats` makes them."""
    h = hashlib.blake2b(f"{prefix}\0{burst}\0{index}".encode(), digest_size=24).hexdigest()
    return prefix + h


def response_body(res: Result, *, burst: str, model: str) -> dict[str, Any]:
    """OpenAI's Response object for a successful result (key order as OpenAI writes it)."""
    echo = res.echo or {}
    incomplete = res.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    created = int(res.timings.admitted or res.timings.enqueued)
    message = {
        "id": _uid("msg_", burst, res.index),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": res.text, "annotations": [], "logprobs": []}],
    }
    return {
        "id": _uid("resp_", burst, res.index),
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "completed_at": None if incomplete else int(res.timings.finished or created),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "model": model,
        "output": [message],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": echo.get("temperature", 1.0),
        "text": echo.get("text") or {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": echo.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": {
            "input_tokens": res.prompt_tokens,
            "input_tokens_details": {"cached_tokens": res.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": res.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": res.prompt_tokens + res.output_tokens,
        },
        "user": None,
        "metadata": echo.get("metadata") or {},
    }
