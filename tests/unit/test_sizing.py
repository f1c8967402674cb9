"""The batch width and KV budget an engine takes, over memory sizes, models and settings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxd.protocol.memory import ROW_TOKENS
from mlxd.protocol.sizing import (
    AUTO_WIDTH_CAP,
    GIB,
    MIN_HEADROOM,
    PROBE_FLOOR,
    UNKNOWN_MEMORY_WIDTH,
    headroom_bytes,
    kv_memory_tokens,
    parse_batch,
    pays,
    plateau_width,
    short_memory_hint,
    size_engine,
    wanted_tokens,
)

# KV bytes per token: Llama-3.2-1B (16 layers, 8 KV heads of 64, bf16) and Llama-3.1-8B (32 x 8 x 128).
KV_1B, KV_8B = 2 * 16 * 8 * 64 * 2, 2 * 32 * 8 * 128 * 2


def test_the_memory_left_for_kv_is_after_weights_prompt_cache_and_headroom() -> None:
    assert kv_memory_tokens(None, 0, 0, KV_1B) is None
    assert kv_memory_tokens(16 * GIB, 0, 0, 0) is None  # a config without the sizes
    # 16 GiB: 10% headroom (1.6 GiB), 4.5 GiB of weights, 1.6 GiB of prompt cache.
    left = 16 * GIB - int(16 * GIB * 0.1) - int(4.5 * GIB) - int(1.6 * GIB)
    assert kv_memory_tokens(16 * GIB, int(4.5 * GIB), int(1.6 * GIB), KV_8B) == left // KV_8B
    assert kv_memory_tokens(2 * GIB, 0, 0, 1) == 2 * GIB - MIN_HEADROOM  # small memory: the headroom's floor
    assert kv_memory_tokens(4 * GIB, 5 * GIB, 0, KV_8B) == 0  # the weights alone do not fit


def test_an_h200_with_a_1b_model_gets_the_widest_batch() -> None:
    memory = kv_memory_tokens(140 * GIB, int(2.5 * GIB), 14 * GIB, KV_1B)
    sizing = size_engine(width=None, context=131072, memory_tokens=memory, device="cuda")
    assert sizing.width == AUTO_WIDTH_CAP["cuda"] >= 64
    assert sizing.kv_budget_tokens == wanted_tokens(131072, sizing.width) == sizing.width * ROW_TOKENS
    assert "the most on cuda" in sizing.why and not sizing.is_clamped


def test_a_16_gb_mac_with_a_7b_4bit_model_gets_a_width_that_fits() -> None:
    # Metal's recommended working set on a 16 GB Mac is about 10.7 GiB; 4 GiB of weights.
    memory = kv_memory_tokens(int(10.7 * GIB), 4 * GIB, int(1.6 * GIB), KV_8B)
    assert memory is not None
    sizing = size_engine(width=None, context=32768, memory_tokens=memory, device="metal")
    assert 1 <= sizing.width < AUTO_WIDTH_CAP["metal"]
    assert sizing.kv_budget_tokens <= memory  # never over-committed
    assert wanted_tokens(32768, sizing.width + 1) > memory  # and one more row would not fit
    assert "as many as memory holds" in sizing.why


def test_claude_codes_44k_prompt_fits_a_64k_model_on_a_24_gb_machine() -> None:
    # A tiny model (a few MB) with a 65536-token window: the budget is the whole window.
    memory = kv_memory_tokens(24 * GIB, 8 * 1024**2, int(2.4 * GIB), 2 * 2 * 2 * 16 * 4)
    sizing = size_engine(width=None, context=65536, memory_tokens=memory, device="cpu")
    assert sizing.kv_budget_tokens >= 65536 > 44090


def test_a_window_memory_cannot_hold_is_clamped_and_says_what_to_change() -> None:
    sizing = size_engine(width=None, context=131072, memory_tokens=50_000, device="metal")
    assert (sizing.width, sizing.kv_budget_tokens) == (1, 50_000)
    assert sizing.is_clamped and "all that memory holds" in sizing.why
    assert "`batch` or `max_context`" in short_memory_hint(sizing)
    roomy = size_engine(width=None, context=4096, memory_tokens=10**6, device="metal")
    assert "max_context" in short_memory_hint(roomy) and not roomy.is_clamped


def test_a_configured_width_wins_but_memory_still_bounds_its_budget() -> None:
    assert size_engine(width=64, context=8192, memory_tokens=10**7, device="cpu").width == 64  # past the cap
    tight = size_engine(width=64, context=8192, memory_tokens=100_000, device="cuda")
    assert (tight.width, tight.kv_budget_tokens) == (64, 100_000)
    assert "batch 64 (configured)" in tight.why


def test_a_configured_kv_budget_is_taken_as_it_is() -> None:
    sizing = size_engine(width=None, context=8192, memory_tokens=None, device="cpu", kv_budget_tokens=777)
    assert (sizing.width, sizing.kv_budget_tokens) == (UNKNOWN_MEMORY_WIDTH, 777)
    assert "(configured)" in sizing.why and "not known" in sizing.why


def test_unknown_memory_keeps_the_old_width_and_books_the_whole_window() -> None:
    sizing = size_engine(width=None, context=65536, memory_tokens=None, device="cpu")
    assert (sizing.width, sizing.kv_budget_tokens) == (UNKNOWN_MEMORY_WIDTH, 65536)


@given(
    width=st.none() | st.integers(1, 256),
    context=st.integers(16, 1 << 20),
    memory=st.none() | st.integers(0, 1 << 26),
    device=st.sampled_from(["cpu", "metal", "cuda", "other"]),
)
def test_the_budget_never_exceeds_memory_and_covers_what_it_can(
    width: int | None, context: int, memory: int | None, device: str
) -> None:
    sizing = size_engine(width=width, context=context, memory_tokens=memory, device=device)
    assert sizing.width == width if width is not None else 1 <= sizing.width <= AUTO_WIDTH_CAP.get(device, 8)
    wanted = wanted_tokens(context, sizing.width)
    if memory is None:
        assert sizing.kv_budget_tokens == wanted
    else:
        assert sizing.kv_budget_tokens == max(1, min(wanted, memory))


@pytest.mark.parametrize("device", ["cpu", "metal", "cuda"])
def test_more_memory_never_means_a_narrower_batch_or_smaller_budget(device: str) -> None:
    last = size_engine(width=None, context=32768, memory_tokens=0, device=device)
    for memory in range(0, 2_000_000, 25_000):
        sizing = size_engine(width=None, context=32768, memory_tokens=memory, device=device)
        assert sizing.width >= last.width and sizing.kv_budget_tokens >= last.kv_budget_tokens
        last = sizing


def test_a_configured_kv_budget_s_refusal_says_to_raise_it() -> None:
    sizing = size_engine(width=4, context=8192, memory_tokens=10**6, device="cpu", kv_budget_tokens=600)
    assert sizing.kv_configured and "--kv-budget-tokens" in short_memory_hint(sizing)


@pytest.mark.parametrize(("text", "width"), [("auto", None), ("AUTO", None), (" auto ", None), ("1", 1), ("64", 64)])
def test_parse_batch(text: str, width: int | None) -> None:
    assert parse_batch(text) == width


@pytest.mark.parametrize("text", ["0", "-1", "eight", "", "1.5"])
def test_parse_batch_refuses_what_is_no_width(text: str) -> None:
    with pytest.raises(ValueError):
        parse_batch(text)


def test_the_probe_keeps_each_width_that_still_pays_for_its_slower_streams() -> None:
    # An H200-like curve: every doubling adds a lot, to the widest probed.
    assert plateau_width({1: 300, 2: 590, 4: 1150, 8: 2100, 16: 3600, 32: 4800, 64: 5600, 128: 6300}) == 128
    # A laptop-like curve: past 16 rows a doubling adds under PROBE_GAIN.
    assert plateau_width({1: 30, 2: 58, 4: 100, 8: 150, 16: 180, 32: 190, 64: 195}) == 16
    # One noisy width does not end the search when a wider one clears the bar from the last kept.
    assert plateau_width({1: 100, 2: 190, 4: 200, 8: 420, 16: 430}) == 8
    # A width that is not a power of two is judged pro rata (37 rows: 1.16x the rows of 32).
    assert plateau_width({16: 1000, 32: 1900, 37: 2150}) == 37
    assert plateau_width({16: 1000, 32: 1900, 37: 1930}) == 32  # needs 1.02x: 1,938
    # Never below the floor (concurrency), nor above what was probed.
    assert plateau_width({1: 100, 2: 101, 4: 102, 8: 103, 16: 104}) == PROBE_FLOOR
    assert plateau_width({1: 100, 2: 101, 4: 102}) == 4
    assert pays({8: 100.0, 16: 111.0}, 8, 16) and not pays({8: 100.0, 16: 109.0}, 8, 16)


def test_a_probed_width_narrows_auto_but_never_a_configured_width_or_past_memory() -> None:
    memory = kv_memory_tokens(140 * GIB, int(2.5 * GIB), 14 * GIB, KV_1B)
    probed = size_engine(width=None, context=131072, memory_tokens=memory, device="cuda", probed=(32, "probe 1.2 s"))
    assert (probed.width, probed.kv_budget_tokens, probed.auto) == (32, wanted_tokens(131072, 32), True)
    assert probed.why.startswith("batch auto: 32 (wider stopped paying; probe 1.2 s); KV budget")
    wide = size_engine(width=None, context=131072, memory_tokens=memory, device="cuda", probed=(128, "probe 2.0 s"))
    assert wide.width == 128 and wide.why.startswith("batch auto: 128 (the most on cuda; probe 2.0 s)")
    configured = size_engine(width=64, context=131072, memory_tokens=memory, device="cuda", probed=(32, "probe"))
    assert (configured.width, configured.auto) == (64, False)
    # Memory holds 3 rows of 4096: the probe cannot widen what memory narrows.
    small = size_engine(width=None, context=4096, memory_tokens=3 * 4096, device="metal", probed=(16, "probe"))
    assert small.width == 3 and "as many as memory holds" in small.why


def test_the_headroom_is_a_tenth_of_memory_and_at_least_512_mib() -> None:
    assert headroom_bytes(140 * GIB) == 14 * GIB
    assert headroom_bytes(2 * GIB) == MIN_HEADROOM
    # what the KV is sized within leaves exactly it
    assert kv_memory_tokens(140 * GIB, 10 * GIB, 0, 1) == 140 * GIB - 10 * GIB - headroom_bytes(140 * GIB)
