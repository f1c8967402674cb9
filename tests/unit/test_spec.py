"""Speculative decoding's parts (mlxd/engine/spec/): the n-gram drafter, which drafts a row
keeps, and the pace that stops drafting when it does not pay. The decoder itself runs in real
engines in tests/integration/test_speculation.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxd.engine.gpu.sampling import make_seeded_sampler, token_key
from mlxd.engine.spec.accept import Distribution, accept
from mlxd.engine.spec.ngram import NgramDrafter
from mlxd.engine.spec.pace import (
    COOLDOWN_TOKENS,
    DRAFT,
    EMPTY_RUNS,
    EXPLORE,
    MAX_COOLDOWN_TOKENS,
    PLAIN,
    PLAIN_WINDOW,
    WINDOW,
    Pace,
)

# --- the n-gram drafter ---


def test_it_drafts_what_followed_the_last_tokens_where_they_appeared_before() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3]
    assert NgramDrafter().propose(tokens, 3) == [4, 5, 6]


def test_the_longest_matching_suffix_wins_over_a_more_recent_shorter_one() -> None:
    # "3 4" last appeared before 8; "2 3 4" only before 5.
    tokens = [2, 3, 4, 5, 0, 3, 4, 8, 0, 2, 3, 4]
    assert NgramDrafter().propose(tokens, 2) == [5, 0]


def test_of_equal_matches_the_most_recent_wins() -> None:
    tokens = [7, 8, 1, 7, 8, 2, 7, 8]
    assert NgramDrafter().propose(tokens, 1) == [2]


def test_no_draft_without_an_earlier_occurrence_or_from_a_single_token() -> None:
    d = NgramDrafter()
    assert d.propose([1, 2, 3, 4], 4) == []
    assert d.propose([5, 1, 6, 1], 4) == []  # only "1" repeats: a 1-gram is too weak to draft from
    assert d.propose([1, 2], 0) == []


def test_the_draft_is_cut_at_the_limit_and_at_the_end_of_the_history() -> None:
    tokens = [1, 2, 3, 1, 2]
    d = NgramDrafter()
    assert d.propose(tokens, 8) == [3, 1, 2]  # what follows the earlier "1 2", up to the end
    assert d.propose(tokens, 1) == [3]


def test_it_follows_a_growing_history_incrementally() -> None:
    d = NgramDrafter()
    tokens = [4, 5, 6, 7]
    assert d.propose(tokens, 2) == []
    tokens += [4, 5]
    assert d.propose(tokens, 2) == [6, 7]
    tokens += [6, 9, 4, 5]
    assert d.propose(tokens, 2) == [6, 9]  # the newer continuation
    assert d.propose(tokens, 2) == NgramDrafter().propose(tokens, 2)  # as a fresh index of the same history


# --- which drafts a row keeps ---


def logprobs_with(best: list[int], vocab: int = 8) -> mx.array:
    """Rows whose likeliest token is `best[j]`."""
    rows = mx.full((len(best), vocab), -5.0)
    for j, t in enumerate(best):
        rows[j, t] = -0.1
    return rows


def test_drafting_after_a_next_token_is_drafting_from_the_history_with_it() -> None:
    """propose_after(history, next) (a batch row's: no copy of its history) drafts what
    propose(history + [next]) does, as both grow a token at a time, the run reaching into the
    next token included."""
    import random

    rng = random.Random(7)
    for trial in range(40):
        vocab = rng.choice([3, 5, 12])
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        after, whole = NgramDrafter(), NgramDrafter()
        for _ in range(60):
            nxt, limit = rng.randrange(vocab), rng.randrange(0, 7)
            assert after.propose_after(history, nxt, limit) == whole.propose([*history, nxt], limit), (trial, history)
            history.append(nxt)
    history = [1, 2, 3, 1, 2]
    assert NgramDrafter().propose_after(history, 3, 4) == [1, 2, 3]  # after [1, 2, 3]: the history's end, then 3


def test_greedy_keeps_drafts_while_the_target_agrees_then_takes_its_own_token() -> None:
    greedy = Distribution(temp=0.0)
    assert accept(greedy, logprobs_with([3, 4, 5, 6]), [3, 4, 2]) == [3, 4, 5]
    assert accept(greedy, logprobs_with([3, 4, 5, 6]), [3, 4, 5]) == [3, 4, 5, 6]  # all kept, and a bonus token
    assert accept(greedy, logprobs_with([3, 4]), [1]) == [3]  # the first refused: the target's token alone
    assert accept(greedy, logprobs_with([7]), []) == [7]


def test_top_k_one_is_greedy() -> None:
    assert Distribution(temp=0.9, top_k=1).greedy
    assert not Distribution(temp=0.9).greedy


def test_sampled_drafts_keep_the_targets_distribution() -> None:
    """The first emitted token, over many draws, is distributed as the target's (tempered)
    distribution, whichever token was drafted: rejection sampling is exact. Keys are fixed, so
    the result is the same every run; the tolerance is five standard errors."""
    p = mx.array([0.5, 0.3, 0.15, 0.05])
    dist = Distribution(temp=1.0)
    logprobs = mx.log(mx.broadcast_to(p, (2, 4)))
    trials = 1500  # each way: 6,000 verifications in all
    for seeded in (False, True):  # rejection sampling; a seeded row's draws, one key a place
        for draft in (0, 3):
            counts = [0, 0, 0, 0]
            for i in range(trials):
                mx.random.seed(i * 7 + draft)
                keys = [token_key(i, draft), token_key(i, draft + 1)] if seeded else None
                counts[accept(dist, logprobs, [draft], keys)[0]] += 1
            for token, want in enumerate(p.tolist()):  # type: ignore[arg-type]
                got = counts[token] / trials
                assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / trials), (seeded, draft, counts)


def test_a_draft_the_target_would_never_sample_is_always_refused() -> None:
    dist = Distribution(temp=1.0, top_k=2)  # tokens 2 and 3 are filtered out
    logprobs = mx.log(mx.broadcast_to(mx.array([0.5, 0.3, 0.15, 0.05]), (3, 4)))
    for i in range(50):
        mx.random.seed(i)
        out = accept(dist, logprobs, [3, 3])
        assert len(out) == 1 and out[0] in (0, 1)
        out = accept(dist, logprobs, [3, 3], [token_key(i, 0), token_key(i, 1), token_key(i, 2)])
        assert len(out) == 1 and out[0] in (0, 1)


def test_a_seeded_rows_tokens_are_the_ones_decoding_without_drafts_draws() -> None:
    """With the keys of their places, every token a verification emits is the one the seeded
    sampler of plain decoding draws at that place (gpu/sampling.py), whatever was drafted: the
    drafts that agree with those draws are kept, the first that does not is replaced by it."""
    args = {"temp": 0.9, "top_p": 0.95, "min_p": 0.0, "top_k": 20}
    dist = Distribution(**args)
    logits = 3 * mx.random.normal((4, 50), key=mx.random.key(0))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    differ = 0
    for seed in range(20):
        start = 5 * seed  # a reply's place: a continued one starts past its first token
        plain = [int(make_seeded_sampler(args, seed, position=start + j)(logprobs[j:j + 1]).item()) for j in range(4)]
        keys = [token_key(seed, start + j) for j in range(4)]
        assert accept(dist, logprobs, plain[:3], keys) == plain  # all kept, and the draw after them
        wrong = (plain[1] + 1) % 50
        assert accept(dist, logprobs, [plain[0], wrong, plain[2]], keys) == plain[:2]
        assert accept(dist, logprobs, [], keys[:1]) == plain[:1]
        differ += plain != [int(make_seeded_sampler(args, seed + 1, position=start + j)(logprobs[j:j + 1]).item())
                            for j in range(4)]
    assert differ > 10  # the seed decides the draws (so the equalities above say something)


# --- the pace ---


def test_the_draft_length_grows_when_all_are_kept_and_shrinks_otherwise() -> None:
    pace = Pace(4)
    assert pace.length == 4
    pace.verified(4, 2)
    assert pace.length == 3
    pace.verified(3, 3)
    assert pace.length == 4
    pace.verified(4, 4)
    assert pace.length == 4  # never past the configured number
    for length in (3, 2, 1, 1):
        pace.verified(pace.length, pace.length - 1 if pace.length > 1 else 0)
        assert pace.length == length  # never under one
    assert pace.drafting


def test_drafting_pauses_after_verifications_that_keep_nothing_and_comes_back() -> None:
    pace = Pace(4)
    for _ in range(EMPTY_RUNS):
        assert pace.drafting
        pace.verified(2, 0)
    assert not pace.drafting
    pace.spent(COOLDOWN_TOKENS - 1, 0.01)
    assert not pace.drafting
    pace.spent(1, 0.01)
    assert pace.drafting


def test_drafting_steps_that_find_nothing_pause_the_row_too() -> None:
    pace = Pace(4, timed=False)  # a batch row: the batch reads its next tokens to ask it for drafts
    for _ in range(EMPTY_RUNS - 1):
        pace.found_none()
        assert pace.drafting
    pace.found_none()
    assert not pace.drafting  # paused: a batch of such rows steps plain, a pass ahead
    pace.spent(COOLDOWN_TOKENS, 0.01)
    assert pace.drafting
    for _ in range(EMPTY_RUNS):
        pace.found_none()
    pace.spent(COOLDOWN_TOKENS, 0.01)
    assert not pace.drafting  # the second pause is twice as long
    pace.spent(COOLDOWN_TOKENS, 0.01)
    assert pace.drafting


def test_a_row_starts_from_what_the_rows_before_it_measured() -> None:
    from mlxd.engine.spec.pace import Rates

    rates = Rates()
    first = Pace(4, memory=rates)
    assert first.regime == DRAFT  # nothing known: drafting is measured first
    run_tokens(first, draft_s=0.012, plain_s=0.010, tokens=WINDOW + PLAIN_WINDOW)
    assert rates.draft == pytest.approx(0.012) and rates.plain == pytest.approx(0.010)
    second = Pace(4, memory=rates)  # the next request: plain first, drafting measured after EXPLORE
    ran = run_tokens(second, draft_s=0.012, plain_s=0.010, tokens=EXPLORE + WINDOW)
    assert ran[:EXPLORE] == [PLAIN] * EXPLORE and ran[EXPLORE] == DRAFT
    paid = Rates()
    paid.draft, paid.plain = 0.004, 0.010
    assert Pace(4, memory=paid).regime == DRAFT


def test_a_row_plain_on_the_lanes_word_measures_drafting_when_challenged() -> None:
    """A row started plain from the rows before it (`hearsay`) measures drafting at once when its
    own guesses say it would pay, and goes back to plain, exploring as usual, if it still loses."""
    from mlxd.engine.spec.pace import Rates

    rates = Rates()
    rates.draft, rates.plain = 0.012, 0.010
    pace = Pace(4, memory=rates)
    assert pace.regime == PLAIN and pace.hearsay
    run_tokens(pace, draft_s=0.012, plain_s=0.010, tokens=3)  # a partial plain window...
    pace.challenge()
    assert pace.drafting and not pace.hearsay
    ran = run_tokens(pace, draft_s=0.006, plain_s=0.010, tokens=WINDOW + EXPLORE)
    assert ran == [DRAFT] * (WINDOW + EXPLORE)  # drafting won: it leads
    assert pace.rate(DRAFT) == pytest.approx(0.006 + 0.006 * 0.5 ** 5)  # 5 windows of its own, the plain tokens not in them

    slower = Rates()
    slower.draft, slower.plain = 0.012, 0.010
    losing = Pace(4, memory=slower)
    losing.challenge()
    ran = run_tokens(losing, draft_s=0.02, plain_s=0.010, tokens=WINDOW + EXPLORE)
    assert ran[:WINDOW] == [DRAFT] * WINDOW and ran[WINDOW] == PLAIN
    assert not losing.hearsay
    losing.challenge()
    assert losing.regime == PLAIN  # measured by the row itself: no more challenges
    ran += run_tokens(losing, draft_s=0.02, plain_s=0.010, tokens=EXPLORE + PLAIN_WINDOW)
    assert DRAFT not in ran[WINDOW:WINDOW + 2 * EXPLORE]  # it lost its own measure: explored twice as late
    assert ran[WINDOW + 2 * EXPLORE] == DRAFT

    measured = Pace(4)  # no memory: drafting first, as always
    assert not measured.hearsay


def run_tokens(pace: Pace, draft_s: float, plain_s: float, tokens: int) -> list[str]:
    """Feed `tokens` tokens one at a time, each timed at its regime's seconds per token; the
    regime of each."""
    ran = []
    for _ in range(tokens):
        ran.append(pace.regime)
        pace.spent(1, draft_s if pace.regime == DRAFT else plain_s)
    return ran


def test_where_drafting_is_slower_it_runs_ever_less() -> None:
    pace = Pace(4)
    ran = run_tokens(pace, draft_s=0.012, plain_s=0.010, tokens=4000)
    assert ran[:WINDOW] == [DRAFT] * WINDOW  # each measured once at the start
    assert ran[WINDOW:WINDOW + EXPLORE] == [PLAIN] * EXPLORE  # the faster one, its first window counted
    assert ran[WINDOW + EXPLORE] == DRAFT  # measured again (it loses again)
    assert ran.count(DRAFT) <= 6 * WINDOW
    assert ran[-1500:].count(DRAFT) <= WINDOW  # explored less and less often
    assert pace.rate(DRAFT) == pytest.approx(0.012) and pace.rate(PLAIN) == pytest.approx(0.010)


def test_where_drafting_pays_plain_decoding_runs_only_to_be_measured() -> None:
    pace = Pace(4)
    ran = run_tokens(pace, draft_s=0.004, plain_s=0.010, tokens=4000)
    assert ran[:WINDOW] == [DRAFT] * WINDOW
    assert ran[WINDOW:WINDOW + PLAIN_WINDOW] == [PLAIN] * PLAIN_WINDOW
    assert ran.count(PLAIN) <= 6 * PLAIN_WINDOW
    assert ran[-1500:].count(PLAIN) <= PLAIN_WINDOW


def test_when_what_pays_changes_the_pace_follows() -> None:
    pace = Pace(4)
    run_tokens(pace, draft_s=0.004, plain_s=0.010, tokens=300)
    ran = run_tokens(pace, draft_s=0.030, plain_s=0.010, tokens=300)  # the context grew, say
    assert ran[-100:].count(DRAFT) == 0
    ran = run_tokens(pace, draft_s=0.002, plain_s=0.010, tokens=3000)
    assert ran[-200:].count(DRAFT) == 200


@pytest.mark.parametrize("runs", [1, 3, 10])
def test_the_pause_doubles_up_to_its_cap(runs: int) -> None:
    pace = Pace(2)
    pause = COOLDOWN_TOKENS
    for _ in range(runs):
        for _ in range(EMPTY_RUNS):
            pace.verified(2, 0)
        left = 0
        while not pace.drafting:
            pace.spent(1, 0.0)
            left += 1
            if pace.regime != DRAFT:  # a window ended and plain decoding gets measured: not the pause
                break
        if pace.regime == DRAFT:
            assert left == pause
        pause = min(MAX_COOLDOWN_TOKENS, pause * 2)


# --- configuration: [pool] and [models.NAME] to the engine's flags ---


def test_the_draft_goes_from_the_config_to_the_engines_flags(tmp_path: Path) -> None:
    from mlxd.engine.settings import parse_args
    from mlxd.supervisor.config import ConfigError, decode_config
    from mlxd.supervisor.engines.engine import Engine, EngineOptions
    from mlxd.supervisor.engines.pool import engine_args_from
    from mlxd.supervisor.registry import config_entries

    config = decode_config(b'[pool]\ndraft = "ngram"\nnum_draft_tokens = 6\n[models.a]\npath = "/m/a"\n'
                           b'[models.b]\npath = "/m/b"\ndraft = "none"\n[models.c]\npath = "/m/c"\nnum_draft_tokens = 2\n',
                           tmp_path / "c.toml")
    pool_args = engine_args_from(config.pool)
    entries = {e.id: e for e in config_entries(config.models)}
    argv = {name: Engine(name, e.path, tmp_path, options=EngineOptions(engine_args=pool_args),
                         draft=(e.draft, e.num_draft_tokens)).argv() for name, e in entries.items()}
    settings = {name: parse_args(a) for name, a in argv.items()}  # the engine reads the last of a repeated flag
    assert (settings["a"].draft, settings["a"].num_draft_tokens) == ("ngram", 6)
    assert (settings["b"].draft, settings["b"].num_draft_tokens) == ("none", 6)
    assert (settings["c"].draft, settings["c"].num_draft_tokens) == ("ngram", 2)
    assert "--draft" not in engine_args_from(decode_config(b"", tmp_path / "d.toml").pool)  # off by default
    for bad in (b'[pool]\ndraft = "self:0"\n', b'[models.a]\npath = "/m"\ndraft = "self:two"\n',
                b'[pool]\ndraft = ""\n', b'[models.a]\npath = "/m"\nnum_draft_tokens = 0\n'):
        with pytest.raises(ConfigError):
            decode_config(bad, tmp_path / "bad.toml")


@pytest.mark.parametrize(("flags", "error"), [(["--draft", "self:0"], "--draft"),
                                              (["--num-draft-tokens", "0"], "--num-draft-tokens")])
def test_the_engine_refuses_bad_draft_flags(flags: list[str], error: str, capsys: pytest.CaptureFixture[str]) -> None:
    from mlxd.engine.settings import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--model", "m", "--model-id", "m", "--socket", "s", *flags])
    assert exited.value.code == 2 and error in capsys.readouterr().err


# --- the opt-out and usage.speculation through the Anthropic and Responses translations ---


def test_anthropic_and_responses_requests_carry_the_opt_out_and_answers_the_drafts() -> None:
    import json

    import msgspec

    from mlxd.protocol import anthropic as an
    from mlxd.protocol import responses as rs

    msg = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}
    assert an.to_chat(msgspec.json.decode(json.dumps({**msg, "speculation": False}), type=an.MessagesRequest))[
        "speculation"] is False
    assert "speculation" not in an.to_chat(msgspec.json.decode(json.dumps(msg), type=an.MessagesRequest))
    req = msgspec.json.decode(json.dumps({"model": "m", "input": "hi", "speculation": False}), type=rs.ResponsesRequest)
    assert rs.to_chat(req, [], rs.input_items(req))["speculation"] is False
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "speculation": {"proposed": 6, "accepted": 4}}
    assert msgspec.to_builtins(an.usage_of(usage))["speculation"] == {"proposed": 6, "accepted": 4}
    assert rs.usage_of(usage)["speculation"] == {"proposed": 6, "accepted": 4}
    assert "speculation" not in msgspec.to_builtins(an.usage_of({"prompt_tokens": 5}))
    assert "speculation" not in rs.usage_of({"prompt_tokens": 5})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(json.dumps({**msg, "speculation": "no"}), type=an.MessagesRequest)


def test_a_batch_rows_pace_is_not_timed_and_a_batchs_windows_scale_with_its_width() -> None:
    row = Pace(4, timed=False)
    run_tokens(row, draft_s=0.030, plain_s=0.010, tokens=1000)
    assert row.regime == DRAFT and row.rate(DRAFT) is None  # the batch decides for it
    batch = Pace(1, scale=8)
    ran = run_tokens(batch, draft_s=0.030, plain_s=0.010, tokens=4000)
    assert ran[:8 * WINDOW] == [DRAFT] * (8 * WINDOW)
    assert ran[8 * WINDOW:8 * (WINDOW + EXPLORE)] == [PLAIN] * (8 * EXPLORE)


def test_a_forgetful_pace_measures_both_regimes_again_drafting_first() -> None:
    pace = Pace(1, scale=8)
    run_tokens(pace, draft_s=0.030, plain_s=0.010, tokens=20000)  # drafting lost and lost again: backed off
    assert pace.regime == PLAIN and pace.rate(DRAFT) is not None
    pace.forget()
    assert pace.regime == DRAFT and pace.rate(DRAFT) is None and pace.rate(PLAIN) is None
    ran = run_tokens(pace, draft_s=0.010, plain_s=0.030, tokens=8 * (WINDOW + PLAIN_WINDOW) + 100)
    assert ran[:8 * WINDOW] == [DRAFT] * (8 * WINDOW)  # drafts at once, and keeps them where they now pay
    assert ran[-100:] == [DRAFT] * 100


# --- the batch's verification width (mlxd/engine/spec/width.py) ---


def cpu_costs() -> Any:
    """8 rows of SmolLM2 on the 2-core CPU: a pass of 1, 2, 3 and 5 positions a row (ms)."""
    from mlxd.engine.spec.width import PassCosts

    costs = PassCosts()
    for positions, ms in ((1, 142), (2, 202), (3, 253), (5, 338)):
        costs.add(positions, ms / 1000)
    return costs


def test_expected_tokens_count_a_run_of_kept_drafts_and_the_models_own() -> None:
    from mlxd.engine.spec.width import expected_tokens

    assert expected_tokens(0, 0.9) == 1.0
    assert expected_tokens(2, 0.5) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(4, 1.0) == 5.0


def test_a_batch_checks_drafts_only_as_wide_as_they_pay() -> None:
    from mlxd.engine.spec.width import best_width

    costs = cpu_costs()
    assert best_width([4] * 8, [0.8] * 8, costs) >= 3  # an edit: every row copies
    assert best_width([4, 0, 0, 0, 0, 0, 0, 0], [0.5] + [0.7] * 7, costs) == 0  # a story: one row, half kept
    assert best_width([0] * 8, [0.9] * 8, costs) == 0
    assert best_width([4, 4, 4, 4, 0, 0, 0, 0], [0.9] * 4 + [0.7] * 4, costs) in (1, 2, 3, 4)


def test_a_width_never_measured_is_priced_from_the_one_below_so_it_gets_tried() -> None:
    from mlxd.engine.spec.width import UNMEASURED_STEP, PassCosts, best_width

    assert best_width([4] * 8, [0.3] * 8, PassCosts()) == 4  # nothing measured: try drafts
    costs = cpu_costs()
    assert costs.relative(4) == pytest.approx(253 / 142 + UNMEASURED_STEP)
    assert costs.relative(8) == pytest.approx(338 / 142 + 3 * UNMEASURED_STEP)


def test_a_width_one_bad_step_made_costly_is_measured_again() -> None:
    """A step slowed by other work (a prefill chunk) moves a width's mean by at most MAX_JUMP
    times it; a width not chosen for STALE steps gets cheaper span by span until it is tried
    again, its next step taken whole."""
    from mlxd.engine.spec.width import DECAY, MAX_JUMP, STALE, best_width

    costs = cpu_costs()
    costs.add(5, 10.0)  # a step that waited seconds for something else
    assert costs.relative(5) == pytest.approx((338 + 0.2 * (MAX_JUMP - 1) * 338) / 142)
    slow = cpu_costs()
    slow.add(5, 3.0)
    slow._seconds[5] = 3.0  # as if it had been measured that slow from the start
    assert best_width([4] * 8, [0.9] * 8, slow) < 4  # not chosen...
    steps = 0
    while best_width([4] * 8, [0.9] * 8, slow) < 4:
        slow.add(1, 0.142)
        steps += 1
        assert steps < 40 * STALE
    assert steps > 4 * STALE  # ... for a while: its price fell a span at a time
    assert slow.relative(5) == pytest.approx(1 + (3.0 / 0.142 - 1) * DECAY ** (steps // STALE), rel=0.05)
    slow.add(5, 0.338)
    assert slow.relative(5) == pytest.approx(0.338 / 0.142)  # taken whole, not averaged with the old mean


def test_a_width_measured_costly_stays_costly_across_a_stale_span() -> None:
    """On an H100 a pass of a 4-bit 8B model's 8 rows took about three plain steps (about 61
    against 20.4 ms). After a reply's 256 plain steps it is priced at most a little
    lower, not afresh from below (the first form's 1.4 plain steps paid a losing pass each
    batch), and drafts that do not pay at three plain steps are still not checked."""
    from mlxd.engine.spec.width import DECAY, STALE, PassCosts, best_width

    costs = PassCosts()
    costs.add(1, 0.0204)
    for positions in (2, 3, 4, 5):
        costs.add(positions, 0.058 + 0.001 * positions)
    for _ in range(STALE):
        costs.add(1, 0.0204)
    assert costs.relative(5) == pytest.approx(1 + (0.063 / 0.0204 - 1) * DECAY)
    assert best_width([4, 4, 0, 0, 0, 0, 0, 0], [0.9] * 8, costs) == 0  # two rows' drafts: 13 tokens for 2.6 steps
    assert best_width([4] * 8, [0.95] * 8, costs) == 4  # every row's: 36 tokens


def test_on_cuda_a_first_pass_is_tried_only_for_drafts_that_would_pay_there() -> None:
    """Before any pass was measured, a pass is priced at CUDA_FIRST_PASS plain steps on MLX's
    CUDA backend (measured 2.5-3.3 there) and FIRST_PASS elsewhere: a story's few hopeful drafts
    are checked on a CPU (and so measured) but not on CUDA; an edit where every row copies is."""
    from mlxd.engine.spec.width import CUDA_FIRST_PASS, FIRST_PASS, PassCosts, best_width

    story = ([4, 4, 0, 0, 0, 0, 0, 0], [0.7] * 8)
    edit = ([4] * 8, [0.9] * 8)
    for first, story_checks in ((FIRST_PASS, True), (CUDA_FIRST_PASS, False)):
        costs = PassCosts(first)
        costs.add(1, 0.02)
        assert costs.relative(2) == pytest.approx(first)
        assert (best_width(*story, costs) > 0) is story_checks
        assert best_width(*edit, costs) > 0


def test_a_widths_first_step_counts_at_most_max_first_times_its_price() -> None:
    """A GPU compiles the kernels of a new shape on its first use: a pass of a width never run
    may take seconds once. It counts at most MAX_FIRST times what the width was priced at."""
    from mlxd.engine.spec.width import MAX_FIRST, UNMEASURED_STEP, PassCosts

    costs = PassCosts()
    costs.add(1, 0.02)
    costs.add(2, 3.0)
    assert costs.relative(2) == pytest.approx(MAX_FIRST * (1 + UNMEASURED_STEP))
    costs.add(3, 0.05)  # a first step under the cap is taken as it is
    assert costs.relative(3) == pytest.approx(2.5)


def test_a_batch_step_that_also_prefilled_does_not_price_a_pass() -> None:
    """mlx-lm's generator counts the prompt tokens it prefilled (`other_work`); a step after which
    it prefilled a chunk is not a pass's cost, and is not sampled."""
    from mlxd.engine.spec.batch import drafting_batch

    batch = drafting_batch(object)()
    work = [0]
    batch.other_work = lambda: work[0]
    batch.batch_pace = Pace(1, scale=8)
    batch._account(0.0)
    batch._last_step = (0.0, {}, 8, 1)
    batch._account(0.15)  # a plain step: measured
    assert batch._costs is not None and batch._costs.relative(1) == 1.0
    batch._last_step = (0.15, {}, 8, 5)
    work[0] += 512  # the generator prefilled a chunk after that step
    batch._account(2.15)
    assert batch._costs._price(5) is None
    batch._last_step = (2.15, {}, 8, 5)
    batch._account(2.45)
    assert batch._costs.relative(5) == pytest.approx(0.3 / 0.15)


def test_a_batch_whose_drafts_cannot_pay_steps_plain_without_reading_its_tokens() -> None:
    """`_may_pay` decides before the host reads the rows' next tokens (which breaks the plain
    steps' pipelining): at the rows' acceptance, with every row drafting its most."""
    from mlxd.engine.spec.batch import RowDrafts, drafting_batch
    from mlxd.engine.spec.serial import Tally
    from mlxd.engine.spec.width import PassCosts

    batch = drafting_batch(object)()
    batch.logits_processors = [[], [], []]
    rows = [RowDrafts(list, Distribution(temp=0.0), Pace(4, timed=False), Tally()) for _ in range(2)]
    costly = PassCosts()  # the H200's 4-bit 8B model, lone: 2 positions 1.9 steps, 5 positions 3.3
    for positions, ms in ((1, 6.7), (2, 13.0), (3, 17.6), (5, 22.1)):
        costly.add(positions, ms / 1000)
    costly.add(4, 20.0 / 1000)
    batch._costs = costly
    assert not batch._may_pay([*rows, None])  # acceptance 0.7: nothing pays
    rows[0].acceptance = 0.97
    assert not batch._may_pay([*rows, None])  # one row's drafts widen every row's pass
    rows[1].acceptance = 0.97
    assert batch._may_pay([*rows, None])  # two rows nearly always right pay for it
    for _ in range(3):
        rows[0].pace.found_none()  # ... until one pauses
    assert not batch._may_pay([*rows, None])
    batch._costs = None  # nothing measured yet: drafts get tried
    assert batch._may_pay([*rows, None])


def test_a_watched_row_could_draft_what_its_standing_guess_has_left() -> None:
    from mlxd.engine.spec.batch import RowDrafts
    from mlxd.engine.spec.serial import Tally
    from mlxd.engine.spec.width import Guess

    rd = RowDrafts(list, Distribution(temp=0.0), Pace(4, timed=False), Tally())
    assert rd.could_draft() == 4  # not watched yet: its draft length
    rd.watched = True
    assert rd.could_draft() == 0  # watched, and it guessed nothing
    rd.shadow = Guess([7, 8, 9])  # 7 would be its next token: 8 and 9 are drafts after it
    assert rd.could_draft() == 2
    rd.shadow = Guess([7, 8, 9, 1, 2, 3, 4])
    assert rd.shadow.score(7) is None  # came true: 8 is next
    assert rd.could_draft() == 4
    assert rd.shadow.score(5) == pytest.approx(1 / 7)  # one of seven came true


def test_a_batch_backs_off_drafting_steps_that_checked_nothing() -> None:
    from mlxd.engine.spec.batch import RowDrafts, drafting_batch
    from mlxd.engine.spec.serial import Tally

    batch = drafting_batch(object)()
    batch.logits_processors = [[]]
    rows = [RowDrafts(list, Distribution(temp=0.0), Pace(4, timed=False), Tally())]
    batch._skip = 2
    assert [batch._may_pay(rows) for _ in range(3)] == [False, False, True]


def test_a_batch_measures_drafting_afresh_when_half_its_live_rows_are_new_and_not_on_rows_that_cannot_draft() -> None:
    """Eight new rows in a batch configured 32 wide are a new batch (its pace forgets); a step of
    rows that opted out of drafting is not timed as drafting or not (the pace would learn that
    drafting does not pay from rows that never drafted)."""
    import time

    from mlxd.engine.spec.batch import drafting_batch

    batch = drafting_batch(object)()
    batch.batch_pace_width = 32
    batch.batch_pace = Pace(1, scale=32)
    batch.batch_pace.regime = PLAIN
    batch.uids = list(range(8))
    batch._note_rows()
    assert batch.batch_pace.regime == DRAFT and batch.batch_pace.rate(PLAIN) is None
    now = time.perf_counter()
    batch._last_step = (now - 0.1, {}, 8, 1)  # 8 rows, none drafting
    batch._account(now)
    assert batch.batch_pace._window_tokens == 0


def test_the_drafting_batch_reads_the_generators_prefill_counter() -> None:
    """attach wires `other_work` to mlx-lm's generator: it moves when the generator prefills."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models import llama

    from mlxd.engine.spec.batch import attach

    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
                                        vocab_size=64))
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    assert attach(gen, lambda uid: None)
    steps = type(gen._generation_batch)
    before = steps.other_work()
    gen.insert([[1, 2, 3, 4, 5, 6]], max_tokens=[4])
    while not gen._generation_batch.uids:
        gen.next()
    assert steps.other_work() > before
    gen.close()


def test_a_draft_picks_the_token_the_targets_greedy_sampler_picks_in_bfloat16() -> None:
    """Logits closer than bf16's step after `logits - logsumexp` tie there, and mlx-lm's greedy
    sampler (the target's) takes the lowest id; the draft must too, not the raw logits' argmax."""
    from mlx_lm.sample_utils import make_sampler

    from mlxd.engine.spec.drafters import greedy_pick

    logits = mx.zeros((2, 50000), dtype=mx.bfloat16)
    logits[0, 7] = 0.03  # a flat row: the raw argmax is 7, the log probabilities all round alike
    logits[1, 9] = 4.0  # a clear winner
    target = make_sampler(0.0)(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert mx.argmax(logits, axis=-1).tolist() == [7, 9]
    assert greedy_pick(logits).tolist() == target.tolist() == [0, 9]


def test_hope_opens_a_row_where_the_last_one_ended_and_retries_with_backoff() -> None:
    from mlxd.engine.spec.width import ACCEPTANCE_START, MAX_RETRY_TOKENS, RETRY_TOKENS, Hope

    hope = Hope()
    assert hope.opening() == ACCEPTANCE_START  # nothing known
    hope.kept(0.9)
    assert hope.opening() == 0.9  # a lane whose drafts pay opens rows at their acceptance
    hope.kept(0.1)
    hope.plain(RETRY_TOKENS - 1)
    assert hope.opening() == 0.1  # drafts that were refused: the next row does not draft
    hope.plain(1)
    assert hope.opening() == ACCEPTANCE_START  # the lane decoded RETRY_TOKENS plain: hope again, once
    assert hope.opening() == 0.1
    hope.kept(0.05)  # the retry was refused too: the next waits twice as long
    hope.plain(RETRY_TOKENS)
    assert hope.opening() == 0.05
    hope.plain(RETRY_TOKENS)
    assert hope.opening() == ACCEPTANCE_START
    for _ in range(10):
        hope.kept(0.0)
        hope.plain(MAX_RETRY_TOKENS)
        assert hope.opening() == ACCEPTANCE_START  # never longer than MAX_RETRY_TOKENS
    hope.kept(ACCEPTANCE_START)  # a row's drafts paid again: the wait starts over
    hope.kept(0.2)
    hope.plain(RETRY_TOKENS)
    assert hope.opening() == ACCEPTANCE_START


def test_a_batch_row_opens_at_what_the_lanes_rows_kept_and_tells_the_lane() -> None:
    """The batch lane's rows share one Hope: a row joining after rows whose drafts were refused
    opens at their acceptance, and its own verifications and scored guesses update it."""
    from types import SimpleNamespace

    from mlxd.engine.spec.batch import BatchDrafts
    from mlxd.engine.spec.config import DraftConfig
    from mlxd.engine.spec.width import ACCEPTANCE_START

    def seq() -> SimpleNamespace:
        sampling = SimpleNamespace(temperature=0.0, top_p=1.0, min_p=0.0, top_k=0, seed=None)
        job = SimpleNamespace(speculate=True, media=None, sampling=sampling)
        return SimpleNamespace(job=job, tally=None, grown_history=lambda: [1, 2, 3, 1, 2])

    drafts = BatchDrafts(DraftConfig.parse("ngram", 4))
    drafts.add(1, seq())
    first = drafts.rows[1]
    assert first.acceptance == ACCEPTANCE_START  # nothing known yet
    first.watch(3, 4)  # guesses 1, 2 after [.., 1, 2, 3]
    first.watch(9, 4)  # refused at once: 0 of 2
    assert drafts.hope.acceptance == first.acceptance < ACCEPTANCE_START
    drafts.add(2, seq())
    assert drafts.rows[2].acceptance == first.acceptance  # the next row opens there


def test_a_drafting_step_that_found_nothing_to_check_is_counted_and_steps_plain() -> None:
    """The host read the rows' next tokens for nothing (a pipeline break on a GPU):
    `draft_batch_idle_reads` counts it, the step is the generator's own, and the batch backs off."""
    from types import SimpleNamespace

    import mlx.core as mx

    from mlxd.engine.gpu.stats import Stats
    from mlxd.engine.spec.batch import RowDrafts, drafting_batch
    from mlxd.engine.spec.serial import Tally

    own = [SimpleNamespace(uid=1, token=5)]

    class Plain:
        def next(self) -> list[SimpleNamespace]:
            return own

    batch = drafting_batch(Plain)()
    batch.stats = Stats()
    batch.uids = [1]
    batch.logits_processors = [[]]
    batch.max_tokens, batch._num_tokens = [100], [3]
    batch._next_tokens, batch._next_logprobs = mx.array([9]), [mx.zeros((4,))]
    rows = [RowDrafts(lambda: [1, 2, 3, 4], Distribution(temp=0.0), Pace(4, timed=False), Tally())]  # 9 follows nothing
    assert batch._draft_step(0.0, rows) is own
    assert batch.stats.draft_batch_idle_reads == 1 and batch.stats.draft_batch_passes == 0
    assert batch._skip == 1  # the next step is plain without a look
