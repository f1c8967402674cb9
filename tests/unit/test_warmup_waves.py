"""The warm-up's jobs (mlxd/engine/gpu/warmup.py): which prompts each wave sends."""

from __future__ import annotations

from mlxd.engine.gpu.warmup import LONG_MIN, LONG_TAIL, LONG_TOKENS, NEW_TOKENS, long_tokens, waves


def test_the_long_wave_fits_the_window_and_the_budget_or_is_left_out() -> None:
    assert long_tokens(131072, 500_000) == LONG_TOKENS  # past 4,096: the widest softmax, the two-pass decode
    assert LONG_TOKENS > 4096
    assert long_tokens(4096, 500_000) == 4096 - LONG_TAIL - 2 * NEW_TOKENS  # the follow-up fits the window
    assert long_tokens(131072, 3000) == 3000 - LONG_TAIL - 2 * NEW_TOKENS  # and the KV budget
    assert long_tokens(1024, 500_000) == 0 and long_tokens(131072, LONG_MIN) == 0  # too small: none


def test_a_long_prompt_and_its_continuation_come_first_then_the_short_waves() -> None:
    short = waves(49152, 4)
    assert [len(w) for w in short] == [1, 1, 4]
    both = waves(49152, 4, 2000)
    assert [len(w) for w in both] == [1, 1, 1, 1, 4]
    story, follow = both[0][0].prompt, both[1][0].prompt
    assert len(story) == 2000 and follow[:2000] == story and len(follow) == 2000 + LONG_TAIL
    # The short waves are as without it: wave 2 continues wave 1, and the batch wave continues wave 2's prefix.
    assert [[j.prompt for j in w] for w in both[2:]] == [[j.prompt for j in w] for w in short]
    assert all(0 < t < 49152 for w in both for j in w for t in j.prompt)
