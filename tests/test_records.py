"""Request parsing and validation honour the settings' limits, not built-in defaults."""

from __future__ import annotations

import pytest

from prefixq.core.errors import ValidationError
from prefixq.core.inputs import normalize
from prefixq.core.settings import Settings


def test_a_dict_request_is_checked_against_the_settings_prompt_limit() -> None:
    """A prompt over the default 4,000,000 characters passes when the settings allow more, and a
    prompt over a lower setting is refused, naming the limit."""
    big = {"id": "big", "prompt": "x" * 4_500_000, "max_tokens": 4}
    (req,) = normalize([big], Settings(max_prompt_chars=5_000_000))
    assert req.prompt is not None and len(req.prompt) == 4_500_000
    with pytest.raises(ValidationError, match="over 100"):
        normalize([{"id": "a", "prompt": "y" * 200}], Settings(max_prompt_chars=100))


def test_a_chat_over_the_settings_message_limit_is_refused() -> None:
    """max_messages from the settings applies to OpenAI batch lines too."""
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}] * 3},
    }
    with pytest.raises(ValidationError, match="3 messages, over 2"):
        normalize([line], Settings(max_messages=2))
