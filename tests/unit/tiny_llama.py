"""A tiny random llama built in the test's own process (2 layers, 64 wide), for tests that drive
mlx-lm's batch generator directly on the CPU."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama


def tiny_llama(seed: int, vocab: int) -> llama.Model:
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model
