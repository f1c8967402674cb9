"""Build a random-weight vision-language model dir, from mlx-vlm's own model classes, for tests and
benchmarks: a Qwen2-VL shape (multimodal rotary positions, image tokens that scale with the
image's pixels), a Gemma 3 shape (a SigLIP tower, a fixed number of tokens per image, sliding
window layers) and a Gemma 4 shape with an audio tower beside its vision tower (per-layer
inputs, layers that share another's KV). Each comes with its processor files and a chat template
that renders image (and audio) parts, so mlx-vlm's loader and processors take it as they take a
real one. Needs the `vision` extra."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken

from mlxd.engine.models.random_model import make_tokenizer

FAMILIES = ("qwen2_vl", "gemma3")  # the vision families every image test runs on
AUDIO_FAMILIES = ("gemma4",)  # ... and those with an audio tower too

QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
GEMMA_SPECIALS = ["<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>"]
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'audio' %}<|audio|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA4_SPECIALS = ["<bos>", "<start_of_turn>", "<end_of_turn>", "<|image|>", "<|image>", "<image|>", "<|audio|>",
                   "<|audio>", "<audio|>", "<|video|>"]


@dataclass(frozen=True)
class Dims:
    """A random VLM's sizes: the language model's, and its vision tower's (`vision_*`)."""

    hidden: int = 64
    layers: int = 2
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    vision_layers: int = 1
    vision_hidden: int = 32
    image_tokens: int = 16  # a Gemma image's tokens; a Qwen image's at most (its pixels are capped so)


def build_random_vlm(out: Path, family: str = "qwen2_vl", *, vocab_size: int = 384, dtype: str = "float32",
                     seed: int = 0, dims: Dims = Dims()) -> Path:
    """Write a random `family` VLM (config, weights, tokenizer, processor files) into `out`."""
    if family not in (*FAMILIES, *AUDIO_FAMILIES):
        raise ValueError(f"family must be one of {(*FAMILIES, *AUDIO_FAMILIES)}, not {family!r}")
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    specials = {"qwen2_vl": QWEN_SPECIALS, "gemma3": GEMMA_SPECIALS, "gemma4": GEMMA4_SPECIALS}[family]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    ids = {s: int(tok.token_to_id(s) or 0) for s in [*specials, "<|im_start|>", "<|im_end|>", "<|endoftext|>"]}
    vocab = tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    if family == "qwen2_vl":
        config, files = _qwen(ids, vocab, dims)
    elif family == "gemma3":
        config, files = _gemma(ids, vocab, dims)
    else:
        config, files = _gemma4(ids, vocab, dims)
    config["torch_dtype"] = dtype
    _write_weights(out, family, config, dtype, seed)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name, value in files.items():
        (out / name).write_text(json.dumps(value, indent=2))
    return out


def _qwen(ids: dict[str, int], vocab: int, dims: Dims) -> tuple[dict[str, Any], dict[str, Any]]:
    # 28-pixel cells (a 14-pixel patch, merged 2x2) make one token each: cap the pixels at `image_tokens` cells.
    cell = 28 * 28
    image_tokens = dims.image_tokens
    half = dims.hidden // dims.heads // 2  # rotary frequencies: split among time, height and width
    sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    config = {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": dims.hidden, "num_hidden_layers": dims.layers, "intermediate_size": dims.intermediate,
        "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads, "rms_norm_eps": 1e-6,
        "vocab_size": vocab, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": sections},
        "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"], "bos_token_id": None,
        "vision_config": {"model_type": "qwen2_vl", "depth": dims.vision_layers, "embed_dim": dims.vision_hidden,
                          "hidden_size": dims.hidden, "num_heads": 2,
                          "mlp_ratio": 2, "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_channels": 3, "in_chans": 3},
    }
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "min_pixels": cell, "max_pixels": cell * image_tokens, "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True, "do_rescale": True,
        "do_normalize": True, "do_convert_rgb": True,
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": QWEN_TEMPLATE, "model_max_length": 4096,
    }
    return config, {"preprocessor_config.json": preprocessor, "tokenizer_config.json": tok_config,
                    "generation_config.json": {"eos_token_id": ids["<|im_end|>"]}}


def _gemma(ids: dict[str, int], vocab: int, dims: Dims) -> tuple[dict[str, Any], dict[str, Any]]:
    image_tokens = dims.image_tokens
    side = int(image_tokens ** 0.5)
    if side * side != image_tokens:
        raise ValueError("a Gemma image's tokens must be a square")
    patch = 14
    config = {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": ids["<image_soft_token>"], "pad_token_id": ids["<|endoftext|>"],
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "eos_token_id": [ids["<end_of_turn>"]], "hidden_size": dims.hidden, "vocab_size": vocab,
        "mm_tokens_per_image": image_tokens,
        "text_config": {"model_type": "gemma3_text", "hidden_size": dims.hidden, "num_hidden_layers": dims.layers,
                        "intermediate_size": dims.intermediate, "num_attention_heads": dims.heads,
                        "num_key_value_heads": dims.kv_heads, "head_dim": dims.hidden // dims.heads, "vocab_size": vocab,
                        "query_pre_attn_scalar": dims.hidden // dims.heads, "sliding_window": 512,
                        "sliding_window_pattern": 2,
                        "mm_tokens_per_image": image_tokens, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6},
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": dims.vision_layers,
                          "hidden_size": dims.vision_hidden, "intermediate_size": 2 * dims.vision_hidden,
                          "num_attention_heads": 2, "patch_size": patch,
                          "image_size": patch * side * 2, "num_channels": 3, "layer_norm_eps": 1e-6},
    }
    size = patch * side * 2
    preprocessor = {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": size, "width": size}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 2,
        "do_pan_and_scan": False,
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<end_of_turn>", "bos_token": "<bos>",
        "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": GEMMA_TEMPLATE, "model_max_length": 4096,
        "add_bos_token": False,
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
    }
    return config, {"preprocessor_config.json": preprocessor, "tokenizer_config.json": tok_config,
                    "processor_config.json": {"image_seq_length": image_tokens, "processor_class": "Gemma3Processor"},
                    "generation_config.json": {"eos_token_id": [ids["<end_of_turn>"]]}}


def _gemma4(ids: dict[str, int], vocab: int, dims: Dims) -> tuple[dict[str, Any], dict[str, Any]]:
    head = dims.hidden // dims.heads
    layers = max(dims.layers, 4)  # the last two share the KV of the first two
    # An image's tokens at most: one of the counts Gemma 4's image processors take, the nearest.
    soft = min((70, 140, 280, 560, 1120), key=lambda n: abs(n - dims.image_tokens))
    config = {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "image_token_id": ids["<|image|>"], "boi_token_id": ids["<|image>"], "eoi_token_id": ids["<image|>"],
        "audio_token_id": ids["<|audio|>"], "boa_token_id": ids["<|audio>"], "eoa_token_id": ids["<audio|>"],
        "video_token_id": ids["<|video|>"], "eos_token_id": [ids["<end_of_turn>"]], "vocab_size": vocab,
        "text_config": {"model_type": "gemma4_text", "hidden_size": dims.hidden, "num_hidden_layers": layers,
                        "intermediate_size": dims.intermediate, "num_attention_heads": dims.heads,
                        "num_key_value_heads": dims.kv_heads, "head_dim": head, "global_head_dim": head,
                        "vocab_size": vocab, "vocab_size_per_layer_input": vocab, "hidden_size_per_layer_input": 16,
                        "num_kv_shared_layers": 2, "sliding_window": 512, "max_position_embeddings": 4096,
                        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)},
        "vision_config": {"hidden_size": dims.vision_hidden, "intermediate_size": 2 * dims.vision_hidden,
                          "num_hidden_layers": dims.vision_layers, "num_attention_heads": 2, "num_key_value_heads": 2,
                          "head_dim": 16, "global_head_dim": 16, "position_embedding_size": 256},
        "audio_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "subsampling_conv_channels": [8, 4], "output_proj_dims": 32},
    }
    processor = {
        "processor_class": "Gemma4Processor", "image_seq_length": soft, "audio_seq_length": 750,
        "audio_ms_per_token": 40,
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True,
                            "do_normalize": False, "do_rescale": True, "do_resize": True, "image_mean": [0.5] * 3,
                            "image_std": [0.5] * 3, "max_soft_tokens": soft, "patch_size": 16,
                            "pooling_kernel_size": 3, "resample": 3, "rescale_factor": 1 / 255,
                            "size": {"height": 224, "width": 224}},
        "feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor", "sampling_rate": 16000,
                              "num_mel_filters": 128, "fft_length": 512, "hop_length": 160},
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<end_of_turn>", "bos_token": "<bos>",
        "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": GEMMA4_TEMPLATE, "model_max_length": 4096,
        "add_bos_token": False, "processor_class": "Gemma4Processor",
        "image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
        "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
    }
    return config, {"processor_config.json": processor, "tokenizer_config.json": tok_config,
                    "generation_config.json": {"eos_token_id": [ids["<end_of_turn>"]]}}


def _write_weights(out: Path, family: str, config: dict[str, Any], dtype: str, seed: int) -> None:
    """mlx-vlm's model class for `family`, made from `config` with random weights, saved as its loader reads them."""
    import importlib

    module = importlib.import_module(f"mlx_vlm.models.{family}")
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    for key, cls_name in (("text_config", "TextConfig"), ("vision_config", "VisionConfig"),
                          ("audio_config", "AudioConfig")):
        sub = getattr(model_config, key, None)
        if isinstance(sub, dict):
            setattr(model_config, key, getattr(module, cls_name).from_dict(sub))
    mx.random.seed(seed)
    model = module.Model(model_config)
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    weights = {k: (v.astype(getattr(mx, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in flat}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
