"""A Llama-3.1-8B-shaped model with dummy weights: ``config.json`` only, no download.

vLLM's ``load_format="dummy"`` fills the weights randomly, so the compute per token equals the
real model's; without a tokenizer (``skip_tokenizer_init``) prompts go in as token ids and every
request generates exactly ``max_tokens`` with ``ignore_eos``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

NAME = "dummy:llama-3.1-8b"
VOCAB = 128_256

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": VOCAB,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}


def dummy_model() -> tuple[str, dict[str, Any]]:
    """(folder with config.json, the engine args a dummy model needs)."""
    folder = Path(tempfile.mkdtemp(prefix="prefixq-llama8b-"))
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B, indent=1))
    return str(folder), {"load_format": "dummy", "skip_tokenizer_init": True}
