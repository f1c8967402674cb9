"""Shared prefill in a real engine: requests that start together with a long prefix the prompt
cache lacks prefill it once, and each starts from it (mlxd/engine/gpu/batch_lane.py, sharing.py).

The requests are made to start in one turn: a blocker holds the engine's KV budget while they
queue, and leaves once all of them wait. Greedy answers are compared with the same requests run
one by one on an engine without a prompt cache.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    FAULTY_ENGINE,
    EngineProcess,
    complete,
    engine_client,
    engine_env,
    hold_until,
    lanes,
    running_engine,
    start_in_one_turn,
    text_of,
    wait_for,
)

WORDS = ["river", "lamp", "stone", "cloud", "field", "glass", "rope", "seed"]
SHARED = "Notes shared by every agent. " + " ".join(
    f"Fact {i}: the {w} is number {i * 7 % 13}." for i, w in enumerate(WORDS * 5))
MAX_TOKENS = 12


def bodies(prefix: str, n: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"prompt": f"{prefix} Question {i}: which fact names the {WORDS[i]}?", "max_tokens": MAX_TOKENS, **extra}
            for i in range(n)]


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture(scope="module")
def alone(tiny_model: Path) -> Iterator[EngineProcess]:
    """The same requests one at a time, nothing cached or shared: what the answers must be."""
    with running_engine(tiny_model, "tiny", "--batch", "8", "--prompt-cache-bytes", "0") as engine:
        yield engine


def answers_alone(engine: EngineProcess, sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [complete(engine, **b) for b in sent]


def budget_for(answers: list[dict[str, Any]], fits: int) -> int:
    """A KV budget that holds the first `fits` of these requests at once (each books its prompt
    and max_tokens), and no more."""
    return sum(a["usage"]["prompt_tokens"] + MAX_TOKENS for a in answers[:fits]) + 8


def held_back(engine: EngineProcess, sent: list[dict[str, Any]]) -> list[Any]:
    """`sent` started in one turn (support.start_in_one_turn): the futures of their answers."""
    return start_in_one_turn(engine, [functools.partial(complete, engine, **b) for b in sent])


def together_and_alone(tiny_model: Path, alone: EngineProcess, sent: list[dict[str, Any]], fits: int
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """`sent` one by one on `alone`, then started together on a fresh engine whose KV budget holds
    `fits` of them at once: the answers alone, together, and the engine's lanes after."""
    expected = answers_alone(alone, sent)
    with running_engine(tiny_model, "tiny", "--batch", "8", "--prefill-step", "64",
                        "--kv-budget-tokens", str(budget_for(expected, fits))) as engine:
        together = [f.result() for f in held_back(engine, sent)]
        return expected, together, lanes(engine)


def test_requests_sharing_a_long_new_prefix_prefill_it_once_and_answer_as_alone(
    tiny_model: Path, alone: EngineProcess
) -> None:
    expected, together, after = together_and_alone(tiny_model, alone, bodies(SHARED, 4), fits=4)
    shared_tokens = complete(alone, SHARED, max_tokens=1)["usage"]["prompt_tokens"]
    assert [a["status"] for a in together] == [200] * 4
    assert [text_of(a) for a in together] == [text_of(a) for a in expected]
    # The first to start ran the shared prefix; the other three started from it, and say so.
    first, *others = sorted(cached(a) for a in together)
    assert first == 0 and len(set(others)) == 1 and others[0] >= shared_tokens - 2, together
    assert (after["shared_prefills"], after["shared_tokens"]) == (1, 3 * others[0])


def test_prompts_that_differ_after_a_few_tokens_are_not_shared(tiny_model: Path, alone: EngineProcess) -> None:
    sent = [{"prompt": f"Agent {w}. {SHARED}", "max_tokens": MAX_TOKENS} for w in WORDS[:3]]
    expected, together, after = together_and_alone(tiny_model, alone, sent, fits=3)
    assert [text_of(a) for a in together] == [text_of(a) for a in expected]
    assert [cached(a) for a in together] == [0, 0, 0] and after["shared_prefills"] == 0


def test_rows_started_together_that_all_find_the_same_short_cached_preamble_start_from_it(
    tiny_model: Path, alone: EngineProcess
) -> None:
    # A preamble under half of each prompt: a row of its own would not use it (MIN_CACHED_SHARE),
    # but when every row of the turn finds it, none pads another, and all take it.
    preamble = "System: answer each question briefly, naming the fact it asks about."
    sent = [{"prompt": f"{preamble} {' '.join([w] * 30)} ?", "max_tokens": MAX_TOKENS} for w in WORDS[:3]]
    expected = answers_alone(alone, sent)
    n_preamble = complete(alone, preamble, max_tokens=1)["usage"]["prompt_tokens"]
    assert all(a["usage"]["prompt_tokens"] > 2 * n_preamble for a in expected)
    with running_engine(tiny_model, "tiny", "--batch", "8", "--prefill-step", "64",
                        "--kv-budget-tokens", str(budget_for(expected, 3))) as engine:
        complete(engine, f"{preamble} Something else entirely.", max_tokens=2)  # the preamble, cached
        together = [f.result() for f in held_back(engine, sent)]
        assert [text_of(a) for a in together] == [text_of(a) for a in expected]
        starts = [cached(a) for a in together]
        # each from the preamble (a row whose word begins as the cached turn's next word did
        # matches a token or two more)
        assert all(n_preamble - 2 <= n <= n_preamble + 2 for n in starts), (starts, n_preamble, engine.log())


def test_those_the_kv_budget_holds_back_start_later_from_the_cached_prefix(
    tiny_model: Path, alone: EngineProcess
) -> None:
    expected, together, after = together_and_alone(tiny_model, alone, bodies(SHARED, 4), fits=2)
    assert [text_of(a) for a in together] == [text_of(a) for a in expected]
    # Two at once share a prefill; the two that waited for room find the prefix cached.
    assert after["shared_prefills"] == 1 and sorted(cached(a) > 0 for a in together) == [False, True, True, True]
    assert after["kv_booked_tokens"] == 0


@pytest.fixture(scope="module")
def slow(tiny_model: Path) -> Iterator[EngineProcess]:
    """The real engine whose shared prefills of SLOWPREFILL prompts take 0.3 s a chunk."""
    proc = EngineProcess(tiny_model, "tiny", "--batch", "8", "--prefill-step", "64", "--kv-budget-tokens", "2400",
                         launcher=FAULTY_ENGINE, env=engine_env(MLXD_BLAS="off"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_a_member_that_leaves_during_the_shared_prefill_ends_and_the_others_answer_as_alone(
    slow: EngineProcess, alone: EngineProcess
) -> None:
    sent = bodies("SLOWPREFILL " + SHARED, 3)
    expected = answers_alone(alone, sent)
    cancelled = slow.stats()["requests"]["cancelled"]
    leaving = {**sent[2], "stream": True}

    def leave_during_prefill() -> bool:
        with engine_client(slow) as c, c.stream("POST", "/v1/completions", json=leaving) as resp:
            assert resp.status_code == 200
            # The shared prefill has started (several slow chunks to go): leave now.
            return bool(wait_for(lambda: lanes(slow)["shared_prefills"] == 1, 60))

    leave, ready = threading.Event(), threading.Event()
    with cf.ThreadPoolExecutor(4) as pool:
        pool.submit(hold_until, slow, leave, ready)
        assert ready.wait(60)
        stayers = [pool.submit(complete, slow, **b) for b in sent[:2]]
        left = pool.submit(leave_during_prefill)
        wait_for(lambda: lanes(slow)["waiting"] == 3, 60, message=lambda: str(lanes(slow)))
        leave.set()
        assert left.result()
        results = [f.result() for f in stayers]
    assert [text_of(r) for r in results] == [text_of(a) for a in expected[:2]]
    assert sorted(cached(r) > 0 for r in results) == [False, True]  # one ran the prefix, one started from it

    def idle() -> bool:
        now = lanes(slow)
        return bool(now["batch"] + now["serial"] + now["waiting"] == 0 and now["kv_booked_tokens"] == 0)

    assert wait_for(idle, 30), lanes(slow)
    assert slow.stats()["requests"]["cancelled"] == cancelled + 2  # the blocker and the one that left


def test_one_arriving_during_the_shared_prefill_joins_it(slow: EngineProcess, alone: EngineProcess) -> None:
    sent = bodies("SLOWPREFILL Latecomers too. " + SHARED, 3)
    expected = answers_alone(alone, sent)
    before = lanes(slow)["shared_prefills"]
    leave, ready = threading.Event(), threading.Event()
    with cf.ThreadPoolExecutor(4) as pool:
        pool.submit(hold_until, slow, leave, ready)
        assert ready.wait(60)
        first = [pool.submit(complete, slow, **b) for b in sent[:2]]
        wait_for(lambda: lanes(slow)["waiting"] == 2, 60, message=lambda: str(lanes(slow)))
        leave.set()
        wait_for(lambda: lanes(slow)["shared_prefills"] == before + 1, 60)
        late = pool.submit(complete, slow, **sent[2])
        results = [f.result() for f in [*first, late]]
    assert [text_of(r) for r in results] == [text_of(a) for a in expected]
    assert lanes(slow)["shared_prefills"] == before + 1  # no second prefill: it joined the first
    assert cached(results[2]) == max(cached(r) for r in results[:2]) > 0


def test_requests_arriving_while_a_lone_one_prefills_the_same_prefix_share_the_rest_of_it(
    slow: EngineProcess, alone: EngineProcess
) -> None:
    """A lone request starts alone in the serial lane; those arriving during its prefill take it
    into the batch lane, and its prefill goes on once for all of them."""
    sent = bodies("SLOWPREFILL Serial first. " + SHARED, 3)
    expected = answers_alone(alone, sent)
    before = lanes(slow)["shared_prefills"]
    with cf.ThreadPoolExecutor(3) as pool:
        first = pool.submit(complete, slow, **sent[0])
        wait_for(lambda: lanes(slow)["serial"] == 1, 60, message=lambda: str(lanes(slow)))
        others = [pool.submit(complete, slow, **b) for b in sent[1:]]
        results = [f.result() for f in [first, *others]]
    assert [text_of(r) for r in results] == [text_of(a) for a in expected]
    assert lanes(slow)["shared_prefills"] == before + 1
    # The lone one ran the prefix (the prompt cache held only its first words, from earlier tests).
    assert cached(results[0]) < 32 < min(cached(r) for r in results[1:]), results


def test_one_whose_own_earlier_turn_is_cached_starts_from_it_not_from_a_shared_prefill(
    slow: EngineProcess, alone: EngineProcess
) -> None:
    """A client's next turn arrives while another client's request prefills the system prompt
    they share: its own previous turn in the prompt cache covers more, so it starts from that
    (a shared prefill would have given it only the system prompt: seen in CI as a turn that
    reused 374 tokens instead of its previous 471)."""
    system = "SLOWPREFILL Own turns. " + SHARED
    first_turn = {"prompt": f"{system} Question 0: which fact names the lamp?", "max_tokens": MAX_TOKENS}
    reply = text_of(complete(slow, **first_turn))
    next_turn = {**first_turn, "prompt": first_turn["prompt"] + reply + " Question 1: and the rope?"}
    # The other client's prompt: the system prompt, then a long text of its own to prefill slowly.
    other = {"prompt": f"{system} " + " ".join(f"Step {i}: move the {w}." for i, w in enumerate(WORDS * 3)),
             "max_tokens": MAX_TOKENS}
    expected = answers_alone(alone, [next_turn, other])
    before = lanes(slow)["shared_prefills"]
    with cf.ThreadPoolExecutor(2) as pool:
        prefilling = pool.submit(complete, slow, **other)
        wait_for(lambda: lanes(slow)["serial"] == 1, 60, message=lambda: str(lanes(slow)))
        turn = pool.submit(complete, slow, **next_turn)
        results = [turn.result(), prefilling.result()]
    assert [text_of(r) for r in results] == [text_of(a) for a in expected]
    earlier = complete(alone, first_turn["prompt"], max_tokens=1)["usage"]["prompt_tokens"]
    assert cached(results[0]) >= earlier, results
    assert lanes(slow)["shared_prefills"] == before  # nothing was worth sharing
