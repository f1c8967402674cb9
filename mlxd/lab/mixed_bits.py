"""Mixed precision over several bit widths: which layer gets which, for a target bits per weight.

mlx-lm's dynamic quantization splits layers between two widths by one threshold. With more
candidate widths (`candidate_bits`), each layer's sensitivity is measured at every width below
the highest, against the highest (mlx_lm.quant.dynamic_quant.estimate_sensitivities: the
first-order growth of the model's KL divergence from the full model when the layer drops to
that width), and the widths are then chosen as a knapsack: every layer starts at the lowest
width, and the upgrade that removes the most estimated loss per bit it costs is taken next,
while it fits the bit budget the target leaves. Pure arithmetic, unit-tested.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence


def layer_bits(size: int, bits: int, overhead: float) -> float:
    """The bits a quantized layer of `size` weights takes at `bits` (its scales and biases:
    `overhead` bits a weight)."""
    return size * (bits + overhead)


def allocate(sizes: Mapping[str, int], levels: Sequence[int], loss: Mapping[int, Mapping[str, float]],
             budget_bits: float, overhead: float) -> dict[str, int]:
    """Each layer's width from `levels`, so that the quantized layers take at most `budget_bits`
    and the summed estimated `loss` (per width below the highest, per layer; the highest's is 0)
    is small. Greedy by loss removed per bit; every layer at the lowest width if even that does
    not fit."""
    levels = sorted(set(levels))
    top = levels[-1]

    def cost(path: str, bits: int) -> float:
        return layer_bits(sizes[path], bits, overhead)

    def lost(path: str, bits: int) -> float:
        return 0.0 if bits == top else loss[bits][path]

    chosen = {path: levels[0] for path in sizes}
    spent = sum(cost(path, levels[0]) for path in sizes)

    def best_upgrade(path: str) -> tuple[float, int] | None:
        """The layer's upgrade with the most loss removed per bit that still fits, if any."""
        now = chosen[path]
        options = []
        for bits in levels:
            extra = cost(path, bits) - cost(path, now)
            if bits > now and spent + extra <= budget_bits:
                options.append(((lost(path, now) - lost(path, bits)) / extra, bits))
        return max(options) if options else None

    heap: list[tuple[float, str, int]] = []
    for path in sizes:
        if (found := best_upgrade(path)) is not None:
            heapq.heappush(heap, (-found[0], path, found[1]))
    while heap:
        _, path, bits = heapq.heappop(heap)
        extra = cost(path, bits) - cost(path, chosen[path])
        if bits <= chosen[path]:
            continue
        if spent + extra > budget_bits:  # the budget shrank since it was pushed: its next best
            if (found := best_upgrade(path)) is not None:
                heapq.heappush(heap, (-found[0], path, found[1]))
            continue
        chosen[path] = bits
        spent += extra
        if (found := best_upgrade(path)) is not None:
            heapq.heappush(heap, (-found[0], path, found[1]))
    return chosen
