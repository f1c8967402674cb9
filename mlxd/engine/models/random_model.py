"""Build a random-weight llama model dir (with a small trained BPE tokenizer) for tests and benchmarks."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Hello, world! How are you today? 0123456789 tokens and numbers.",
    "Streaming text, stop sequences, and caches: an engine serves one model well.",
    "Ünïcödé, 日本語, emoji 🙂 and other multi-byte characters appear too.",
]


def make_tokenizer(vocab_size: int, specials: list[str] = SPECIALS) -> Tokenizer:
    """A byte-level BPE tokenizer trained on a tiny built-in corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def build_random_llama(
    out: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 384,
    context: int = 2048,
    dtype: str = "float32",
    seed: int = 0,
    family: str = "llama",
) -> Path:
    """Write config.json, model.safetensors and tokenizer files for a random llama into `out` (or a
    model of another mlx-lm family of the same shape: `family="qwen2"`)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    config: dict[str, Any] = {
        "model_type": family, "hidden_size": hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size, "vocab_size": tok.get_vocab_size(),
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": context,
        "tie_word_embeddings": False, "torch_dtype": dtype,
    }
    mx.random.seed(seed)
    arch = llama if family == "llama" else importlib.import_module(f"mlx_lm.models.{family}")  # qwen2: pipelines
    model = arch.Model(arch.ModelArgs.from_dict(config))
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in flat}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": CHATML, "model_max_length": context,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return out
