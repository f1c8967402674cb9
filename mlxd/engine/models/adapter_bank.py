"""Adapters served per row: rows under different LoRA adapters share one batched forward pass.

The mounted adapters' modules change class (as flat_rows.py does for quantized layers; the
model's parameters stay as they are) to one that adds the low-rank update of the adapter each
row asked for. Before each forward pass the lane says which adapters each row runs under
(`AdapterBank.rows`): a row's stack (one adapter, several added together, or none) becomes a
plan, and for as long as the pass is built every adapted layer reads it:

- no row under an adapter: the plan is empty and the layers are the base model's;
- every row under the same stack: `(x @ A) @ B`, with A and B of the stack's adapters
  concatenated along the rank (adding the updates of a stack is one update of their summed ranks);
- rows under different stacks: each distinct stack is a slot of the layer's stacked A (S, in, R)
  and B (S, R, out), ranks padded with zeros, slot 0 all zeros for rows under none, and each row
  gathers its own slot: `gather_mm(gather_mm(x, A, idx), B, idx)`. The base weights run once for
  all rows; the updates cost two small matmuls per layer. On an NVIDIA GPU a decode step's
  updates are one kernel launch per layer instead (lora_kernel.py).

DoRA's per-output gain multiplies the row's output (before the bias), the same per row. The
stacked weights of recent plans are kept, so a step whose rows hold the same stacks as the last
reuses them. Mounting reads and checks an adapter (adapters.py) and runs on the GPU thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxd.engine.models import lora_kernel
from mlxd.engine.models.adapters import (
    Adapter,
    AdapterError,
    compute_dtype,
    dense_weight,
    find_module,
    linear_dims,
    read_adapter,
)

Stack = tuple[Adapter, ...]  # the adapters one row runs under, by id; () for the base model
NO_ADAPTER = "none"
PLANS_KEPT = 16  # stacked weights kept for recent row mixes (each is one copy of its adapters' A and B)
# The layers after a group's first that read its input (mlx-lm's attention and MLP call them in
# this order, on one x): their updates go in the first one's launch.
SIBLINGS = {"q_proj": ("k_proj", "v_proj"), "gate_proj": ("up_proj",)}
KERNEL_ENV = "MLXD_LORA_KERNEL"  # 0: decode steps use MLX ops even on CUDA (to compare)
GROUP_ENV = "MLXD_LORA_GROUP"  # 0: one kernel launch a layer, siblings not grouped (to compare)
MERGE_AFTER_PASSES = 8  # passes a stack must have every row to itself before its merged copy is made


@dataclass(frozen=True, eq=False, slots=True)
class LayerWeights:
    a: mx.array  # (in, R) or, per slot, (S, in, R)
    b: mx.array  # (R, out) or (S, R, out)
    gain: mx.array | None  # (out,) or (S, out); None: no DoRA here


@dataclass(frozen=True, eq=False, slots=True)
class Plan:
    weights: dict[str, LayerWeights]
    slots: mx.array | None  # each row's slot (None: every row under the one stack)
    gather: bool  # mx.gather_mm takes this dtype (else the rows' A and B are gathered first)
    fused: bool = False  # decode steps take lora_kernel.py's one-launch update (NVIDIA GPUs)
    done: dict[str, tuple[mx.array, mx.array]] = field(default_factory=dict)  # name -> (its x, its output)
    merged: dict[str, nn.Module] | None = None  # the one stack's layers with its update in their weights


class _Hook:
    """What an adapted layer knows: its bank and its name (a plain object: no parameter)."""

    __slots__ = ("bank", "name")

    def __init__(self, bank: AdapterBank, name: str) -> None:
        self.bank, self.name = bank, name


_classes: dict[type, type] = {}


def _adapted_class(base: type) -> type:
    """`base` with its forward pass followed by the current plan's update for the layer."""
    if (made := _classes.get(base)) is not None:
        return made

    def __call__(self: Any, x: mx.array) -> mx.array:
        hook: _Hook = self._mlxd_adapters
        plan = hook.bank.plan
        if plan is not None and plan.merged is not None and (merged := plan.merged.get(hook.name)) is not None:
            return merged(x)
        if plan is not None and plan.done and (done := plan.done.pop(hook.name, None)) is not None and done[0] is x:
            return done[1]  # made with its group's first layer, in the same launch
        y = base.__call__(self, x)
        if plan is None or (w := plan.weights.get(hook.name)) is None:
            return y
        if plan.fused and w.gain is None and lora_kernel.fits(x, w.a):
            return hook.bank.fused_update(plan, hook.name, x, y, w)
        if plan.slots is None:
            delta = (x @ w.a) @ w.b
            gain = w.gain
        elif plan.gather:
            delta = mx.gather_mm(mx.gather_mm(x, w.a, rhs_indices=plan.slots), w.b, rhs_indices=plan.slots)
            gain = w.gain[plan.slots][:, None, :] if w.gain is not None else None
        else:
            delta = (x @ w.a[plan.slots]) @ w.b[plan.slots]
            gain = w.gain[plan.slots][:, None, :] if w.gain is not None else None
        if gain is None:
            return y + delta.astype(y.dtype)
        bias = self.get("bias")
        if bias is None:
            return (gain * (y + delta)).astype(y.dtype)
        return (gain * (y - bias + delta) + bias).astype(y.dtype)

    made = type(f"Adapted{base.__name__}", (base,), {"__call__": __call__})
    _classes[base] = made
    return made


class AdapterBank:
    """The adapters mounted on one model, and the plan its adapted layers read (GPU thread; the
    loop thread only reads `mounted` to resolve a request's adapter)."""

    def __init__(self, model: nn.Module, refusal: str | None = None) -> None:
        self._model = model
        self._refusal = refusal  # why this model takes no adapters (None: it takes them)
        self.mounted: dict[str, Adapter] = {}
        self.plan: Plan | None = None
        self.mixed_passes = 0  # plans whose rows ran under different stacks (/admin/stats)
        self.merge = False  # run a stack that has every row to itself on merged weights (see `_merged_for`)
        self.fused = os.environ.get(KERNEL_ENV, "1") != "0"  # lora_kernel.py where it runs (0: MLX ops)
        self._merged: tuple[Stack, dict[str, nn.Module]] | None = None
        self._streak: tuple[Stack, int] = ((), 0)  # the stack that had every row in the last passes, how many
        self._plans: OrderedDict[tuple[Stack, ...], dict[str, LayerWeights]] = OrderedDict()
        self._gather: dict[Any, bool] = {}
        self._adapted: set[str] = set()
        self._modules: dict[str, nn.Module] = {}  # fused_update's look-ups of sibling layers
        self._zeros: dict[int, mx.array] = {}  # _slot_zero's, by row count
        self.grouped = os.environ.get(GROUP_ENV, "1") != "0"  # siblings' updates in one launch (0: one each)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.mounted.values())

    def mount(self, adapter_id: str, path: Path) -> Adapter:
        """Read the adapter at `path` as `adapter_id` (replacing one of that id: rows already
        under the old one finish under it) and adapt its layers. AdapterError if it does not fit."""
        if not adapter_id or adapter_id == NO_ADAPTER or "+" in adapter_id:
            raise AdapterError(f"{adapter_id!r} cannot name an adapter")
        if self._refusal is not None:
            raise AdapterError(self._refusal)
        adapter = read_adapter(path, adapter_id, self._model)
        for name in adapter.modules:
            if name not in self._adapted:
                module = find_module(self._model, name)
                object.__setattr__(module, "_mlxd_adapters", _Hook(self, name))
                module.__class__ = _adapted_class(type(module))
                self._adapted.add(name)
        self.mounted[adapter_id] = adapter
        return adapter

    def unmount(self, adapter_id: str) -> bool:
        """Forget the adapter (rows under it finish under it); False if none was mounted."""
        adapter = self.mounted.pop(adapter_id, None)
        if adapter is None:
            return False
        for key in [k for k in self._plans if any(adapter in stack for stack in k)]:
            del self._plans[key]
        if self._merged is not None and adapter in self._merged[0]:
            self._merged = None
        return True

    @property
    def merged_bytes(self) -> int:
        """Memory of the merged copy of the hot stack's layers (0: none)."""
        if self._merged is None:
            return 0
        pairs: list[Any] = [pair for m in self._merged[1].values() for pair in tree_flatten(m.parameters())]
        return sum(array.nbytes for _, array in pairs)

    def resolve(self, spec: str | None) -> Stack:
        """The stack a request's `adapter` names: "id", "a+b", or "none"/""/None for the base.
        ValueError naming an adapter that is not mounted, or a stack that cannot be served."""
        if spec is None or spec.strip() in ("", NO_ADAPTER):
            return ()
        ids = [part.strip() for part in spec.split("+")]
        missing = [i for i in ids if i not in self.mounted]
        if missing:
            raise ValueError(f"Adapter '{missing[0]}' is not loaded on this model")
        stack = tuple(sorted({self.mounted[i] for i in ids}, key=lambda a: a.id))
        if len(stack) > 1 and any(a.kind == "dora" for a in stack):
            raise ValueError("A DoRA adapter cannot be stacked with another adapter")
        return stack

    @contextlib.contextmanager
    def rows(self, stacks: Sequence[Stack]) -> Iterator[None]:
        """The adapted layers add each row's stack's update while this lasts (`stacks[i]` for
        row i of the forward passes built meanwhile); the base model's everywhere after."""
        self.plan = self._plan_for(stacks)
        try:
            yield
        finally:
            self.plan = None

    def one(self, stack: Stack) -> contextlib.AbstractContextManager[None]:
        """`rows` for passes whose rows all run under `stack`."""
        return self.rows([stack])

    def _plan_for(self, stacks: Sequence[Stack]) -> Plan | None:
        distinct = list(dict.fromkeys(stacks))
        if not any(distinct):
            return None
        if len(distinct) == 1:
            stack = distinct[0]
            return Plan(self._weights((stack,), mixed=False), None, False, fused=self.fused and lora_kernel.usable(),
                        merged=self._merged_for(stack))
        self.mixed_passes += 1
        keys = sorted((s for s in distinct if s), key=lambda s: tuple(a.id for a in s))
        order = {stack: i + 1 for i, stack in enumerate(keys)}
        weights = self._weights(tuple(keys), mixed=True)
        dtype = next(iter(weights.values())).a.dtype
        return Plan(weights, mx.array([order.get(s, 0) for s in stacks], dtype=mx.uint32), self._gathers(dtype),
                    fused=self.fused and lora_kernel.usable())

    def fused_update(self, plan: Plan, name: str, x: mx.array, y: mx.array, w: LayerWeights) -> mx.array:
        """Layer `name`'s output with each row's update, by lora_kernel.py: in one launch with the
        layers after it that read the same input (q's with k's and v's, gate's with up's), whose
        outputs wait in `plan.done` until they are called with that same `x`."""
        group = [(y, w.a, w.b)]
        followers = []
        for other in SIBLINGS.get(name.rpartition(".")[2], ()) if self.grouped else ():
            other_name = f"{name.rpartition('.')[0]}.{other}"
            ow = plan.weights.get(other_name)
            if ow is None or ow.gain is not None or not lora_kernel.fits(x, ow.a):
                continue
            if (module := self._modules.get(other_name)) is None:
                module = self._modules[other_name] = find_module(self._model, other_name)
            group.append((type(module).__mro__[1].__call__(module, x), ow.a, ow.b))  # its base output
            followers.append(other_name)
        outs = lora_kernel.rows_update_group(x, plan.slots if plan.slots is not None else self._slot_zero(x.shape[0]),
                                             group)
        for other_name, out in zip(followers, outs[1:], strict=True):
            plan.done[other_name] = (x, out)
        return outs[0]

    def _slot_zero(self, rows: int) -> mx.array:
        """Slot 0 for each of `rows` rows: a one-stack plan's weights are its only slot."""
        if (zeros := self._zeros.get(rows)) is None:
            zeros = self._zeros[rows] = mx.zeros((rows,), dtype=mx.uint32)
            mx.eval(zeros)
        return zeros

    def _merged_for(self, stack: Stack) -> dict[str, nn.Module] | None:
        """The stack's layers with its update merged into their weights, once it has had every
        row to itself for MERGE_AFTER_PASSES passes in a row (one stack at a time is kept):
        such passes then cost what the base model's do, instead of two small matmuls more per
        adapted layer (on a GPU, where each op has a fixed cost, that is most of a small model's
        step). None while the stack runs unmerged."""
        if not self.merge:
            return None
        if self._merged is not None and self._merged[0] == stack:
            return self._merged[1]
        seen, count = self._streak
        self._streak = (stack, count + 1 if seen == stack else 1)
        if self._streak[1] < MERGE_AFTER_PASSES:
            return None
        self._merged = None  # the old copy goes before the new one is made
        made = {name: merged_layer(find_module(self._model, name), w)
                for name, w in self._weights((stack,), mixed=False).items()}
        mx.eval([m.parameters() for m in made.values()])
        self._merged = (stack, made)
        return made

    def _weights(self, stacks: tuple[Stack, ...], mixed: bool) -> dict[str, LayerWeights]:
        """Per adapted layer: one stack's A and B (`mixed` False), or every stack's in slots 1..S."""
        key = (*stacks, ()) if mixed else stacks
        if (found := self._plans.get(key)) is not None:
            self._plans.move_to_end(key)
            return found
        names = sorted({name for stack in stacks for a in stack for name in a.modules})
        made = {name: (_slotted(self._model, name, stacks) if mixed else _joined(name, stacks[0])) for name in names}
        self._plans[key] = made
        while len(self._plans) > PLANS_KEPT:
            self._plans.popitem(last=False)
        return made

    def _gathers(self, dtype: Any) -> bool:
        """Whether mx.gather_mm runs in `dtype` here (MLX's CPU build takes only float32)."""
        if dtype not in self._gather:
            try:
                x = mx.zeros((2, 1, 4), dtype=dtype)
                mx.eval(mx.gather_mm(x, mx.zeros((2, 4, 2), dtype=dtype), rhs_indices=mx.array([1, 0], mx.uint32)))
                self._gather[dtype] = True
            except (RuntimeError, ValueError):
                self._gather[dtype] = False
        return self._gather[dtype]


def merged_layer(module: nn.Module, update: LayerWeights) -> nn.Module:
    """A copy of the (adapted) layer with the update in its weight, as mlx-lm's fuse makes it:
    W + (A B)ᵀ (DoRA: scaled by the gain per output), quantized again as the layer was."""
    original = type(module).__mro__[1]  # the class before it was adapted
    weight = dense_weight(module).astype(mx.float32) + (update.a.astype(mx.float32) @ update.b.astype(mx.float32)).T
    if update.gain is not None:
        weight = update.gain.astype(mx.float32)[:, None] * weight
    d_in, d_out = linear_dims(module)
    bias = module.get("bias")
    linear = nn.Linear(d_in, d_out, bias=bias is not None)
    linear.weight = weight.astype(compute_dtype(module))
    if bias is not None:
        linear.bias = bias
    if not isinstance(module, nn.QuantizedLinear):
        return linear
    quantized = nn.QuantizedLinear.from_linear(linear, module.group_size, module.bits, mode=getattr(module, "mode", "affine"))
    quantized.__class__ = original
    return quantized


def namespace(stack: Stack, first: int) -> int:
    """The prompt cache's key for the first token `first` of a row under `stack`: negative (no
    token id is), from the token and the adapters' contents, so that KV computed under one stack
    is never served to a row under another."""
    h = hashlib.blake2b(int(first).to_bytes(8, "little", signed=True), digest_size=7)
    for adapter in sorted(stack, key=lambda a: a.digest):
        h.update(adapter.digest)
    return -1 - int.from_bytes(h.digest(), "little")


def _joined(name: str, stack: Stack) -> LayerWeights:
    """One stack's update of layer `name`: its adapters' ranks side by side."""
    parts = [a.modules[name] for a in stack if name in a.modules]
    if len(parts) == 1:
        return LayerWeights(parts[0].a, parts[0].b, parts[0].gain)
    return LayerWeights(mx.concatenate([p.a for p in parts], axis=1), mx.concatenate([p.b for p in parts], axis=0),
                        None)  # DoRA is never stacked (AdapterBank.resolve)


def _slotted(model: nn.Module, name: str, stacks: tuple[Stack, ...]) -> LayerWeights:
    """Layer `name`'s update for every stack, one slot each after slot 0 (no update)."""
    d_in, d_out = linear_dims(find_module(model, name))
    joined = [_joined(name, stack) if any(name in a.modules for a in stack) else None for stack in stacks]
    present = [j for j in joined if j is not None]
    dtype = present[0].a.dtype
    rank = max(j.a.shape[1] for j in present)
    a_slots = [mx.zeros((d_in, rank), dtype=dtype)]
    b_slots = [mx.zeros((rank, d_out), dtype=dtype)]
    for j in joined:
        if j is None:
            a_slots.append(a_slots[0])
            b_slots.append(b_slots[0])
        else:
            pad = rank - j.a.shape[1]
            a_slots.append(mx.pad(j.a, [(0, 0), (0, pad)]) if pad else j.a)
            b_slots.append(mx.pad(j.b, [(0, pad), (0, 0)]) if pad else j.b)
    gain = None
    if any(j.gain is not None for j in present):
        ones = mx.ones((d_out,), dtype=dtype)
        gain = mx.stack([ones, *[j.gain if j is not None and j.gain is not None else ones for j in joined]])
    return LayerWeights(mx.stack(a_slots), mx.stack(b_slots), gain)


__all__ = ["NO_ADAPTER", "AdapterBank", "AdapterError", "Stack", "namespace"]
