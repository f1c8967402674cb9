"""A pipeline split for llama-shaped models, which mlx-lm splits only tensor-parallel.

mlx-lm pipelines some families (`model.model.pipeline(group)`: its PipelineMixin). llama, the
most common, is not one of them, yet a pipeline is what a model needs whose heads do not divide
by the ranks (SmolLM2: 9 heads), or a slow link between hosts (a pipeline sends one activation
a rank a step, where tensor parallel sums twice a layer). Here a llama body gets the same split
as mlx-lm's families: rank r keeps a run of the layers (the last run on rank 0), takes the
hidden state from rank r + 1, runs its layers and hands the result to rank r - 1; every rank
then gathers the last rank's output, so each samples from the same logits.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.pipeline import PipelineMixin

from mlxd.engine.models.loaded_model import ModelLoadError

log = logging.getLogger("mlxd.engine")


class _PipelinedBody(PipelineMixin):
    """A llama body (embeddings, full-attention layers, norm) that runs only its rank's layers."""

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None) -> mx.array:
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)  # type: ignore[attr-defined]
        layers = self.pipeline_layers
        cache = cache if cache is not None else [None] * len(layers)
        mask = create_attention_mask(h, cache[0])
        rank, size = self.pipeline_rank, self.pipeline_size
        if rank < size - 1:  # the layers before ours ran on the next rank up
            h = mx.distributed.recv_like(h, rank + 1)
        for layer, c in zip(layers, cache, strict=True):
            h = layer(h, mask, cache=c)
        if rank > 0:
            h = mx.distributed.send(h, rank - 1)
            if cache[-1] is not None:  # the send is part of the step: evaluating the cache runs it
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        if size > 1:  # every rank samples from the last layer's output (rank 0's)
            h = mx.distributed.all_gather(h)[: h.shape[0]]
        return self.norm(h)  # type: ignore[attr-defined]


class _PipelinedModel:
    """The model around a pipelined body: its KV caches are its rank's layers only."""

    @property
    def layers(self) -> list[Any]:
        return self.model.pipeline_layers  # type: ignore[attr-defined]


def pipeline(model: Any, group: Any) -> None:
    """Split `model`'s layers over `group`: mlx-lm's own split where it has one, else this
    module's for a llama body; any other model is a ModelLoadError that says why."""
    inner: Any = getattr(model, "model", None)
    if hasattr(inner, "pipeline"):
        inner.pipeline(group)
        _alike(model)
        _said(inner, group)
        return
    if not _plain_llama(model, inner):
        raise ModelLoadError(f"{getattr(model, 'model_type', 'these')} models cannot be split into a pipeline "
                             "(mlx-lm pipelines some families; mlxd adds llama without sliding-window layers)")
    if len(inner.layers) < group.size():
        raise ModelLoadError(f"the model's {len(inner.layers)} layers do not split over {group.size()} ranks")
    inner.__class__ = type(f"Pipelined{type(inner).__name__}", (_PipelinedBody, type(inner)), {})
    model.__class__ = type(f"Pipelined{type(model).__name__}", (_PipelinedModel, type(model)), {})
    inner.pipeline(group)
    _said(inner, group)


def _alike(model: Any) -> None:
    """Every layer's cache of one kind: the ranks' prompt caches weigh an entry as rank 0's does
    by scaling with the number of layers (ranks.py's `weighed_as`), exact only then. A hybrid
    (fixed-size state beside growing KV, sliding windows beside full attention) is refused."""
    kinds = {type(c).__name__ for c in model.make_cache()} if hasattr(model, "make_cache") else set()
    if len(kinds) > 1:
        raise ModelLoadError(f"this model mixes layer caches ({', '.join(sorted(kinds))}): mlxd cannot keep a "
                             "pipeline's prompt caches in step for it yet; use mode = \"tensor\"")


def _said(inner: Any, group: Any) -> None:
    start, end = getattr(inner, "start_idx", None), getattr(inner, "end_idx", None)
    if start is not None and end is not None:
        total = getattr(inner, "num_hidden_layers", None) or len(inner.layers)  # a rank's list ends at its last
        log.info("pipeline: rank %d runs layers %d-%d of %d", group.rank(), start, end - 1, total)


def _plain_llama(model: Any, inner: Any) -> bool:
    """A llama body whose layers all attend in full, run as `layer(h, mask, cache=c)`."""
    return (type(inner).__name__ == "LlamaModel" and getattr(inner, "swa_idx", None) is None
            and all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm"))
            and hasattr(model, "make_cache"))
