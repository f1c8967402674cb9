"""Random-weight LoRA and DoRA adapters in mlx-lm's format, for tests and benchmarks.

Built the way `mlx_lm.lora` builds and saves one (its `linear_to_lora_layers`, the trainable
parameters to `adapters.safetensors`, the arguments to `adapter_config.json`), with B drawn
at random instead of zeros so that the adapter changes what the model says.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model

DEFAULT_KEYS = ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj")


def build_random_adapter(
    model_dir: Path, out_dir: Path, *, rank: int = 8, scale: float = 10.0, seed: int = 0, dora: bool = False,
    num_layers: int | None = None, keys: tuple[str, ...] | None = DEFAULT_KEYS, base_model: str | None = None,
    strength: float = 0.02,
) -> Path:
    """An adapter for the model at `model_dir` in `out_dir` (rank `rank` on `keys` of the last
    `num_layers` layers, all by default; `keys` None: every linear layer, as mlx-lm's default);
    `strength` is the spread of the random B."""
    model, _ = load_model(model_dir, lazy=True)
    layers = len(model.layers)
    num_layers = layers if num_layers is None else num_layers
    model.freeze()
    params: dict[str, object] = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = list(keys)
    mx.random.seed(seed)  # A is drawn by mlx-lm's layers, B here
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    weights = dict(tree_flatten(model.trainable_parameters()))
    for name, value in list(weights.items()):
        if name.endswith(".lora_b"):
            weights[name] = (strength * mx.random.normal(value.shape)).astype(value.dtype)
        elif name.endswith(".m"):
            weights[name] = value * (1.0 + 0.05 * mx.random.normal(value.shape)).astype(value.dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "adapters.safetensors"), weights)
    config = {
        "fine_tune_type": "dora" if dora else "lora",
        "num_layers": num_layers,
        "lora_parameters": params,
        "model": base_model or str(model_dir),
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir
