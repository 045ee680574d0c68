"""From a request to what placement sees (`Item`): chained block hashes and a token estimate.

With a tokenizer (``settings.tokenizer``, an HF folder: the same model the workers serve), text is
rendered exactly as the worker renders it (chat template included) and hashed per KV block of
``block_size`` tokens. Without one, the same rendering is hashed per ``block_chars`` characters and
tokens are estimated at ~4 characters each. Every producer of a namespace must use the same mode;
the seed includes it, so two modes never share map entries by accident.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

import xxhash

from prefixq.affinity.blocks import chain, chat_text, seed_of, token_blocks
from prefixq.affinity.placement import Item
from prefixq.core.errors import ConfigError
from prefixq.core.records import Request
from prefixq.core.settings import Settings

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4.0
#: shared prefixes whose block hashes are remembered (cleared when full)
_MEMO_ENTRIES = 1024


def load_tokenizer(path: str) -> Any:
    """An HF fast tokenizer from a local folder (no network); ConfigError naming the setting
    when the folder holds none (transformers' own OSError or ValueError said nothing of it)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"tokenizer {path!r} (PREFIXQ_TOKENIZER, --tokenizer) is not a folder holding a "
            f"tokenizer: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e


class ItemBuilder:
    """Builds placement items with one tokenizer (or none) and one seed."""

    def __init__(self, settings: Settings, *, tokenizer: Any = None, model: str = "") -> None:
        self.s = settings
        if tokenizer is None and settings.tokenizer:
            tokenizer = load_tokenizer(settings.tokenizer)
        self.tokenizer = tokenizer
        mode = "tokens" if tokenizer is not None else f"chars{settings.block_chars}"
        self._memo: dict[int, list[int]] = {}
        self.seed = seed_of(f"{model or settings.tokenizer}|{mode}|{settings.block_size}")

    def build(self, req: Request, prefix: dict[str, Any] | None) -> Item:
        """The item for ``req``; ``prefix`` is its shared part (from `entries.split_prefix`)."""
        s = self.s
        if req.inputs is not None:  # embeddings: no prefix to follow (affinity/serving.py)
            chars = sum(len(x) for x in req.inputs if isinstance(x, str))
            ids = sum(len(x) for x in req.inputs if isinstance(x, list))
            return Item(
                blocks=[],
                tokens=max(1, ids + round(chars / CHARS_PER_TOKEN)),
                block_tokens=float(s.block_size),
                prefix_blocks=0,
                key=xxhash.xxh3_64_intdigest(repr(req.inputs[:1]).encode(), seed=self.seed),
            )
        if req.prompt_token_ids is not None:
            pre = len(req.prefix) if isinstance(req.prefix, list) else 0
            tokens = (req.prefix if isinstance(req.prefix, list) else []) + req.prompt_token_ids
            return self._tokens(tokens, pre, memo=True)
        if req.messages is not None:
            if self.tokenizer is not None:
                text = self.tokenizer.apply_chat_template(
                    req.messages, tokenize=False, add_generation_prompt=True
                )
                head = (
                    self.tokenizer.apply_chat_template(prefix["m"], tokenize=False)
                    if prefix
                    else ""
                )
            else:
                text = chat_text(req.messages)
                head = chat_text(prefix["m"]) if prefix else ""
        else:
            head = req.prefix if isinstance(req.prefix, str) else ""
            text = head + (req.prompt or "")
        if self.tokenizer is not None:
            ids = self.tokenizer(text).input_ids
            head_tokens = (
                len(self.tokenizer(head, add_special_tokens=False).input_ids) if head else 0
            )
            return self._tokens(ids, head_tokens)
        bc = s.block_chars
        blocks = self._chain(text.encode("utf-32-le"), bc * 4, len(text) // bc, len(head) // bc)
        return Item(
            blocks=blocks,
            tokens=max(1, round(len(text) / CHARS_PER_TOKEN)),
            block_tokens=s.block_chars / CHARS_PER_TOKEN,
            prefix_blocks=len(head) // s.block_chars,
            key=xxhash.xxh3_64_intdigest(text.encode(), seed=self.seed),
        )

    def _chain(self, buf: bytes, step: int, n: int, n_head: int) -> list[int]:
        """Chained hashes of ``n`` blocks of ``buf``; the first ``n_head`` (a shared prefix's
        whole blocks) come from a memo, so the questions of a document hash only their own part."""
        if n_head <= 0 or n_head > n:
            return chain(buf, step, n, self.seed)
        # the memo keeps a digest, not the prefix
        key = xxhash.xxh3_128_intdigest(memoryview(buf)[: n_head * step])
        head = self._memo.get(key)
        if head is None:
            head = chain(buf, step, n_head, self.seed)
            if len(self._memo) >= _MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = head
        return head + chain(buf, step, n - n_head, head[-1], n_head * step)

    def _tokens(self, tokens: list[int], prefix_tokens: int, memo: bool = False) -> Item:
        bs = self.s.block_size
        if memo:
            buf = array("I", tokens).tobytes()
            blocks = self._chain(buf, bs * 4, len(tokens) // bs, prefix_tokens // bs)
        else:
            blocks = token_blocks(tokens, bs, self.seed)
        return Item(
            blocks=blocks,
            tokens=len(tokens),
            block_tokens=float(bs),
            prefix_blocks=prefix_tokens // bs,
            key=xxhash.xxh3_64_intdigest(repr(tokens[:bs]).encode(), seed=self.seed),
        )
