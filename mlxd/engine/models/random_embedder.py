"""Build random-weight embedding model dirs (mlx-embeddings' classes, sentence-transformers files)
for tests and benchmarks: a BERT (an encoder, `cls` or `mean` pooling) and a Qwen3 embedder (a
decoder, `lasttoken` pooling, as Qwen3-Embedding is)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import processors

from mlxd.engine.embed.model import import_mlx_embeddings
from mlxd.engine.embed.pooling import KEYS
from mlxd.engine.models.random_model import make_tokenizer

BERT_SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_random_bert(out: Path, *, pooling: str = "cls", hidden_size: int = 64, num_layers: int = 2,
                      num_heads: int = 4, intermediate_size: int | None = None, context: int = 128,
                      seed: int = 0) -> Path:
    """An encoder embedding model: `[CLS] text [SEP]`, pooled by `pooling` (all-MiniLM-L6-v2's
    shape: hidden_size 384, num_layers 6, num_heads 12, intermediate_size 1536, context 512)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(384, BERT_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    config: dict[str, Any] = {
        "architectures": ["BertModel"], "model_type": "bert", "hidden_size": hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "intermediate_size": intermediate_size or hidden_size * 2,
        "max_position_embeddings": context, "vocab_size": tok.get_vocab_size(), "type_vocab_size": 2,
        "layer_norm_eps": 1e-12, "torch_dtype": "float32",
    }
    _save(out, "bert", config, tok, seed, {"pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]"})
    _sentence_transformers(out, pooling, hidden_size)
    return out


def build_random_qwen3_embedder(out: Path, *, hidden_size: int = 64, num_layers: int = 2, context: int = 256,
                                seed: int = 0) -> Path:
    """A decoder embedding model: `text<|endoftext|>`, pooled by its last token."""
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(384, QWEN_SPECIALS)
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1", special_tokens=[("<|endoftext|>", eos)])
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": hidden_size * 2, "max_position_embeddings": context, "vocab_size": tok.get_vocab_size(),
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
    }
    _save(out, "qwen3", config, tok, seed, {"pad_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
    _sentence_transformers(out, "lasttoken", hidden_size)
    return out


def _save(out: Path, family: str, config: dict[str, Any], tok: Any, seed: int, specials: dict[str, str]) -> None:
    meu = import_mlx_embeddings()
    module = meu._get_model_arch(config)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config["max_position_embeddings"],
                  **specials}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def _sentence_transformers(out: Path, mode: str, width: int) -> None:
    """modules.json (Transformer, Pooling, Normalize) and the Pooling module's config."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": width, **{key: name == mode for name, key in KEYS.items()}}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
