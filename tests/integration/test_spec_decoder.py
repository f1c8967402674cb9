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
