"""Several candidate bit widths shared out by sensitivity (mlxd/lab/mixed_bits.py)."""

from __future__ import annotations

import random

import pytest

from mlxd.lab.mixed_bits import allocate, layer_bits

OVERHEAD = 0.5  # bfloat16 scales and biases at group size 64


def spend(sizes: dict[str, int], chosen: dict[str, int]) -> float:
    return sum(layer_bits(sizes[p], b, OVERHEAD) for p, b in chosen.items())


def test_the_budget_of_every_layer_at_the_lowest_or_highest_width_gives_that_width() -> None:
    sizes = {"a": 100, "b": 300, "c": 50}
    loss = {3: {"a": 5.0, "b": 1.0, "c": 9.0}, 4: {"a": 2.0, "b": 0.5, "c": 4.0}}
    for bits in (3, 6):
        chosen = allocate(sizes, [3, 4, 6], loss, spend(sizes, dict.fromkeys(sizes, bits)), OVERHEAD)
        assert chosen == dict.fromkeys(sizes, bits)
    assert allocate(sizes, [3, 4, 6], loss, 1.0, OVERHEAD) == dict.fromkeys(sizes, 3)  # nothing fits: the lowest


def test_the_most_sensitive_layer_per_bit_is_raised_first() -> None:
    sizes = {"a": 100, "b": 100, "c": 100}
    loss = {2: {"a": 1.0, "b": 8.0, "c": 3.0}, 4: {"a": 0.5, "b": 2.0, "c": 1.0}}
    low = spend(sizes, dict.fromkeys(sizes, 2))
    # Room to raise one layer from 2 to 4 bits: b's loss falls the most.
    assert allocate(sizes, [2, 4, 8], loss, low + 200, OVERHEAD) == {"a": 2, "b": 4, "c": 2}
    # Room for 600 more bits: every layer to 4 (loss 3.5) rather than b alone to 8 (loss 4).
    assert allocate(sizes, [2, 4, 8], loss, low + 600, OVERHEAD) == {"a": 4, "b": 4, "c": 4}
    # The budget of every layer at 4 bits, spent better: a and c at 6, the large b at 3 (a
    # summed loss of 1.0 against 6.5 with each at 4).
    sizes = {"a": 100, "b": 300, "c": 50}
    loss = {3: {"a": 5.0, "b": 1.0, "c": 9.0}, 4: {"a": 2.0, "b": 0.5, "c": 4.0}}
    budget = spend(sizes, dict.fromkeys(sizes, 4))
    assert allocate(sizes, [3, 4, 6], loss, budget, OVERHEAD) == {"a": 6, "b": 3, "c": 6}


def test_a_larger_layer_costs_more_of_the_budget() -> None:
    sizes = {"big": 1000, "small": 100}
    loss = {4: {"big": 5.0, "small": 1.0}}  # per bit: big 5/2000, small 1/200: small first
    low = spend(sizes, dict.fromkeys(sizes, 4))
    assert allocate(sizes, [4, 6], loss, low + 200, OVERHEAD) == {"big": 4, "small": 6}


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_stays_within_the_budget_and_uses_most_of_it(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {f"l{i}": rng.choice([64, 256, 1024, 4096]) for i in range(30)}
    levels = sorted(rng.sample([2, 3, 4, 5, 6, 8], 3))
    loss = {b: {p: rng.uniform(-0.1, 1.0) * (levels[-1] - b) for p in sizes} for b in levels[:-1]}
    low, high = (spend(sizes, dict.fromkeys(sizes, b)) for b in (levels[0], levels[-1]))
    budget = low + rng.random() * (high - low)
    chosen = allocate(sizes, levels, loss, budget, OVERHEAD)
    assert set(chosen.values()) <= set(levels)
    used = spend(sizes, chosen)
    assert used <= budget
    # What is left over buys no layer its next width.
    for path, bits in chosen.items():
        if bits != levels[-1]:
            up = levels[levels.index(bits) + 1]
            assert budget - used < sizes[path] * (up - bits), (path, bits)
