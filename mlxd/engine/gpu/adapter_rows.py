"""Each row of the batch lane's generator runs under its own adapters (models/adapter_bank.py).

mlx-lm's BatchGenerator runs the model in three places, each on the rows of one batch in that
batch's order (which changes as rows join and leave): its prompt batch's `prompt` (prefill
chunks) and `generate` (a new generation batch of the prefilled rows runs their last prompt
token as it is made), and its generation batch's `_step` (a decode step). Their classes are swapped, as
batch_bias.py swaps the generation batch's, for ones that tell the bank which adapters each
row runs under, in that order, for as long as the pass is built. A split prompt batch keeps
its class (mlx-lm copies it by class). With no adapter mounted the bank's plan is empty.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mlx_lm.generate import BatchGenerator

from mlxd.engine.models.adapter_bank import AdapterBank, Stack

log = logging.getLogger("mlxd.engine")


def attach(gen: BatchGenerator, bank: AdapterBank, stack_of: Callable[[int], Stack]) -> bool:
    """Have `gen`'s batches run each row (by uid) under `stack_of(uid)`; False where mlx-lm's
    generator has another shape (then every row runs under the base model)."""
    prompts, steps = getattr(gen, "_prompt_batch", None), getattr(gen, "_generation_batch", None)
    if prompts is None or steps is None or not hasattr(prompts, "prompt") or not hasattr(steps, "_step"):
        log.warning("mlx-lm's BatchGenerator has changed shape: batched rows run without adapters")
        return False

    def stacks(uids: list[int]) -> list[Stack]:
        return [stack_of(uid) for uid in uids]

    prompt_base: Any = type(prompts)
    step_base: Any = type(steps)

    class RowAdaptedPrompts(prompt_base):
        def prompt(self, tokens: Any) -> Any:
            with bank.rows(stacks(self.uids)):
                return super().prompt(tokens)

        def generate(self, tokens: Any) -> Any:  # the new generation batch runs the rows' last prompt token
            with bank.rows(stacks(self.uids)):
                return super().generate(tokens)

    class RowAdaptedSteps(step_base):
        def _step(self) -> Any:
            with bank.rows(stacks(self.uids)):
                return super()._step()

    prompts.__class__ = RowAdaptedPrompts
    steps.__class__ = RowAdaptedSteps
    return True
