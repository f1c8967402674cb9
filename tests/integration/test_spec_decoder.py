"""The serial lane's speculative decoder (mlxd/engine/spec/serial.py) on a real tiny model, in
process, with drafters that do what a test needs: an oracle (every draft right), a liar
(every draft wrong), a mute (no drafts, so plain steps a pass ahead) and one that alternates.
Whatever they draft, greedy tokens must be mlx-lm's generate_step's; the KV must hold all the
tokens but the last after a release, in either mode; and no call runs past max_tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.spec.accept import Distribution
from mlxd.engine.spec.serial import Speculator

PROMPT = [5, 17, 3, 99, 42, 8, 17, 3, 61, 2, 30, 7]


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    from mlx_lm.utils import load

    return load(str(tiny_model))[0]


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy tokens."""
    cache = make_prompt_cache(model)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache):
        out.append(int(token))
    return out


class Scripted:
    """A drafter whose drafts a function of the history gives."""

    def __init__(self, draft: Callable[[list[int], int], list[int]]) -> None:
        self.draft = draft
        self.calls = 0

    def start(self, tokens: list[int]) -> None:
        pass

    def ready(self, tokens: list[int]) -> bool:
        return bool(self.draft(tokens, 1))

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        self.calls += 1
        return self.draft(tokens, limit)[:limit]


def decoder(model: Any, drafter: Any, max_tokens: int, num_draft: int = 4) -> Speculator:
    """A Speculator as the serial lane makes one: the prompt prefilled but for its last token."""
    cache = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return Speculator(model, cache, list(PROMPT), Distribution(temp=0.0), [], drafter, num_draft, max_tokens)


def run(spec: Speculator, n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        out += [t for t, _ in spec.next_tokens()]
    return out


def drafters(truth: list[int]) -> dict[str, Scripted]:
    def oracle(tokens: list[int], limit: int) -> list[int]:
        done = len(tokens) - len(PROMPT)
        return truth[done:done + limit]

    def liar(tokens: list[int], limit: int) -> list[int]:
        return [(t + 1) % 50 for t in oracle(tokens, limit)]

    def alternating(tokens: list[int], limit: int) -> list[int]:
        return oracle(tokens, limit) if len(tokens) % 3 else liar(tokens, limit)[:1] + oracle(tokens, limit)[1:]

    return {"oracle": Scripted(oracle), "liar": Scripted(liar), "mute": Scripted(lambda t, n: []),
            "alternating": Scripted(alternating)}


@pytest.mark.parametrize("kind", ["oracle", "liar", "mute", "alternating"])
def test_greedy_tokens_are_generate_steps_whatever_is_drafted(model: Any, kind: str) -> None:
    truth = greedy(model, PROMPT, 40)
    drafter = drafters(truth)[kind]
    spec = decoder(model, drafter, 40)
    assert run(spec, 40) == truth
    assert spec.tokens == PROMPT + truth
    assert spec.tally.accepted <= spec.tally.proposed
    if kind == "oracle":
        assert spec.tally.accepted == spec.tally.proposed > 20
    if kind == "liar":
        assert spec.tally.accepted == 0


@pytest.mark.parametrize("kind", ["oracle", "mute"])
@pytest.mark.parametrize("after", [1, 6, 13])
def test_a_release_leaves_the_kv_holding_all_but_the_last_token(model: Any, kind: str, after: int) -> None:
    """In either mode (verifying, or plain with a pass queued); generate_step goes on from there."""
    truth = greedy(model, PROMPT, 30)
    spec = decoder(model, drafters(truth)[kind], 30)
    got = run(spec, after)
    kv = spec.release()
    tokens = spec.tokens
    assert kv[0].offset == len(tokens) - 1
    rest = [int(t) for t, _ in generate_step(mx.array(tokens[-1:]), model, max_tokens=30 - len(got), prompt_cache=kv)]
    assert got + rest == truth


@pytest.mark.parametrize("kind", ["oracle", "mute", "alternating"])
@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_no_call_runs_past_max_tokens(model: Any, kind: str, max_tokens: int) -> None:
    truth = greedy(model, PROMPT, 12)
    spec = decoder(model, drafters(truth)[kind], max_tokens)
    out = run(spec, max_tokens)
    assert out == truth[:max_tokens]
    assert spec.kv[0].offset <= len(PROMPT) + max_tokens


def test_logprobs_come_with_each_token_and_match_plain_decoding(model: Any) -> None:
    truth = greedy(model, PROMPT, 10)
    spec = decoder(model, drafters(truth)["oracle"], 10)
    cache = make_prompt_cache(model)
    plain = [lp for _, lp in generate_step(mx.array(PROMPT), model, max_tokens=10, prompt_cache=cache)]
    got: list[Any] = []
    while len(got) < 10:
        got += [lp for _, lp in spec.next_tokens()]
    for a, b in zip(plain, got, strict=True):
        assert mx.allclose(a.reshape(-1), b.reshape(-1), atol=1e-4).item()


# --- the pass-cost gate (width.py's best_width for the lone row) and its guesses while gated off ---


class FixedCosts:
    """What passes cost by their width, in plain steps, held fixed (a GPU where wide passes cost
    more than this CPU's): the decoder's own timings are not added."""

    def __init__(self, relative: Callable[[int], float]) -> None:
        self._relative = relative

    def add(self, positions: int, seconds: float) -> None:
        pass

    def relative(self, positions: int) -> float:
        return 1.0 if positions == 1 else self._relative(positions)


def gated(model: Any, drafter: Any, max_tokens: int, relative: Callable[[int], float]) -> Speculator:
    from mlxd.engine.spec.pace import Pace, Rates

    rates = Rates()
    rates.costs = FixedCosts(relative)  # type: ignore[assignment]
    cache = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    spec = Speculator(model, cache, list(PROMPT), Distribution(temp=0.0), [], drafter, 4, max_tokens, rates=rates)
    spec.pace = Pace(4, timed=False)  # the gate alone: no windows timing drafting against not (this CPU's noise)
    return spec


def test_drafts_that_cannot_pay_for_their_pass_are_not_even_asked_for(model: Any) -> None:
    """Passes 10x a plain step: not even an oracle's drafts pay, so none is checked and the row
    keeps its plain pipeline (a draft model would not be run either)."""
    truth = greedy(model, PROMPT, 40)
    oracle = drafters(truth)["oracle"]
    spec = gated(model, oracle, 40, lambda positions: 10.0)
    assert run(spec, 40) == truth
    assert spec.tally.proposed == 0
    assert oracle.calls == 0


def test_drafts_are_cut_to_the_length_that_pays(model: Any) -> None:
    """A pass of 2 positions costs next to nothing, wider ones 4x: an oracle drafts one token at a time."""
    truth = greedy(model, PROMPT, 40)
    oracle = drafters(truth)["oracle"]
    asked: list[int] = []
    spec = gated(model, Scripted(lambda tokens, limit: asked.append(limit) or oracle.draft(tokens, limit)), 40,
                 lambda positions: 1.05 if positions == 2 else 4.0)
    assert run(spec, 40) == truth
    assert spec.tally.proposed > 10
    assert spec.tally.accepted == spec.tally.proposed
    assert spec.pace.length == 4  # the pace would draft 4...
    assert set(asked) == {1}  # ... the gate asked for 1 a pass


def test_a_gated_off_ngram_row_scores_its_guesses_and_drafts_once_they_would_pay(model: Any) -> None:
    """Passes priced so that drafts pay only past 0.75 acceptance, above where a row starts: the
    row decodes plain while its n-gram guesses are checked against what it emits; this random
    model repeats itself, so its acceptance rises and it drafts, with mlx-lm's tokens all along."""
    from mlxd.engine.spec.ngram import NgramDrafter
    from mlxd.engine.spec.width import ACCEPTANCE_START, expected_tokens

    assert ACCEPTANCE_START < 0.75
    truth = greedy(model, PROMPT, 120)
    spec = gated(model, NgramDrafter(), 120, lambda positions: expected_tokens(positions - 1, 0.75))
    first = run(spec, 8)
    assert spec.tally.proposed == 0  # gated off from the start
    assert first + run(spec, 120 - len(first)) == truth
    assert spec.tally.proposed > 0
    assert spec.tally.accepted > 0


def test_wrong_guesses_keep_a_gated_off_ngram_row_plain() -> None:
    """A row whose guesses stop coming true loses acceptance without a pass (RowDrafts.watch, the
    batch's form of the same scoring)."""
    from mlxd.engine.spec.batch import RowDrafts
    from mlxd.engine.spec.pace import Pace
    from mlxd.engine.spec.serial import Tally
    from mlxd.engine.spec.width import ACCEPTANCE_START

    history = [1, 2, 3, 4, 1, 2]
    rd = RowDrafts(lambda: history, Distribution(temp=0.0), Pace(4, timed=False), Tally())
    rd.watch(3, 4)  # after [.., 1, 2, 3] the row guesses 4, 1, 2, 3
    history.append(3)
    assert rd.shadow is not None and rd.shadow.tokens == [4, 1, 2, 3] and rd.shadow.seen == 0
    for token in (4, 1):  # two come true...
        rd.watch(token, 4)
        history.append(token)
    assert rd.acceptance == ACCEPTANCE_START
    rd.watch(9, 4)  # ... the third does not: 2 of 4
    history.append(9)
    assert rd.acceptance == pytest.approx(ACCEPTANCE_START + 0.3 * (0.5 - ACCEPTANCE_START))
    assert rd.shadow is None  # nothing ever followed a 9
    rd.watch(7, 4)
    assert rd.shadow is None
    assert rd.acceptance < ACCEPTANCE_START


class Tease:
    """A drafter that always says it has something and never has (a model's drafts cut to nothing)."""

    def __init__(self) -> None:
        self.calls = 0

    def start(self, tokens: list[int]) -> None:
        pass

    def ready(self, tokens: list[int]) -> bool:
        return True

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        self.calls += 1
        return []


def test_drains_that_find_nothing_back_off(model: Any) -> None:
    """Each drain breaks the one-pass-ahead pipeline; one that finds nothing to check makes the
    next wait 1, 2, 4 ... up to 64 plain tokens."""
    from mlxd.engine.spec.serial import MAX_SKIP

    truth = greedy(model, PROMPT, 200)
    tease = Tease()
    spec = decoder(model, tease, 200)
    assert run(spec, 200) == truth
    assert tease.calls <= 2 + 7 + (200 - (1 + 2 + 4 + 8 + 16 + 32)) // MAX_SKIP + 1  # not one a token
    assert tease.calls >= 4


def test_an_ngram_row_drains_only_for_a_guess_that_pays(model: Any) -> None:
    """Passes priced so that only 4 kept drafts pay: guesses shorter than that never break the pipeline."""
    from mlxd.engine.spec.ngram import NgramDrafter

    truth = greedy(model, PROMPT, 120)  # this random model repeats itself: 4-token guesses come
    spec = gated(model, NgramDrafter(), 120, lambda positions: float(positions) if positions < 5 else 1.2)
    spec.acceptance = 1.0
    assert run(spec, 120) == truth
    assert spec.tally.proposed > 0
    assert spec.tally.proposed % 4 == 0  # only passes of 4 drafts were checked


def test_a_row_plain_on_the_lanes_word_drafts_once_its_own_guesses_come_true(model: Any) -> None:
    """The lane's earlier rows measured drafting slower (a story, say), so a new row starts plain;
    its n-gram guesses come true (this random model repeats itself), so it measures drafting
    within its first tokens rather than after EXPLORE of them, with mlx-lm's tokens all along."""
    from mlxd.engine.spec.ngram import NgramDrafter
    from mlxd.engine.spec.pace import EXPLORE, PLAIN, Rates

    truth = greedy(model, PROMPT, 100)
    rates = Rates()
    rates.draft, rates.plain = 1.0, 0.5  # drafting twice as slow, for the rows before
    rates.costs = FixedCosts(lambda positions: 1.0 + 0.05 * positions)  # type: ignore[assignment]
    cache = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    spec = Speculator(model, cache, list(PROMPT), Distribution(temp=0.0), [], NgramDrafter(), 4, 100, rates=rates)
    assert spec.pace.regime == PLAIN
    assert run(spec, 100) == truth
    assert EXPLORE > 100  # without its own evidence it would not have drafted at all
    assert spec.tally.proposed > 0 and spec.tally.accepted > 0


def test_a_new_row_opens_at_what_the_lanes_last_row_kept(model: Any) -> None:
    """A drafter the target never agrees with (a random model's self-draft): the first row learns
    it by drafting; the next row of the lane opens at that acceptance and checks no draft at
    all, with mlx-lm's tokens; once the lane has decoded RETRY_TOKENS without checking a draft,
    a row opens hopeful and drafts again."""
    from mlxd.engine.spec.pace import Pace, Rates
    from mlxd.engine.spec.width import ACCEPTANCE_START, RETRY_TOKENS

    truth = greedy(model, PROMPT, 60)
    rates = Rates()
    rates.costs = FixedCosts(lambda positions: 1.0 + 0.1 * positions)  # type: ignore[assignment]

    def row(drafter: Any) -> Speculator:
        cache = make_prompt_cache(model)
        model(mx.array(PROMPT[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        spec = Speculator(model, cache, list(PROMPT), Distribution(temp=0.0), [], drafter, 4, 60, rates=rates)
        spec.pace = Pace(4, timed=False)  # the gate alone, not the windows
        return spec

    liar = drafters(truth)["liar"]
    first = row(liar)
    assert first.acceptance == ACCEPTANCE_START
    assert run(first, 60) == truth
    assert first.tally.proposed > 0 and first.tally.accepted == 0
    assert rates.hope.acceptance is not None and rates.hope.acceptance < ACCEPTANCE_START
    calls = liar.calls
    second = row(liar)
    assert second.acceptance == rates.hope.acceptance
    assert run(second, 60) == truth
    assert second.tally.proposed == 0 and liar.calls == calls  # not even asked
    plain = 1  # rows of the lane decoded plain since the first
    while (retry := row(liar)).acceptance < ACCEPTANCE_START:
        assert run(retry, 60) == truth
        assert retry.tally.proposed == 0
        plain += 1
        assert plain * 60 < 2 * RETRY_TOKENS
    assert plain * 60 >= RETRY_TOKENS  # hope again once the lane decoded RETRY_TOKENS plain
    assert run(retry, 60) == truth
    assert retry.tally.proposed > 0
