"""Drafts from a model (mlxd/engine/spec/drafters.py) on real tiny models, in process.

A draft model (the target itself, which must then be right every time, or another model of the
same tokenizer) and the layer-skip self-draft: greedy tokens must be mlx-lm's generate_step's
whatever they draft, the KV must hold all tokens but the last after a release, the draft
model's KV keeps the prefix the next request shares, and a draft that cannot work is refused
when it is opened, saying why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxd.engine.gpu.device_memory import size_for
from mlxd.engine.gpu.loader import open_model
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.models.random_model import build_random_llama
from mlxd.engine.spec.accept import Distribution
from mlxd.engine.spec.config import DraftConfig
from mlxd.engine.spec.drafters import ModelDrafter, open_draft, tokenizer_mismatch
from mlxd.engine.spec.serial import Speculator
from mlxd.protocol.memory import kv_bytes_per_token

PROMPT = [5, 17, 3, 99, 42, 8, 17, 3, 61, 2, 30, 7]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {
        "target": build_random_llama(root / "target", num_layers=4, seed=3),
        "draft": build_random_llama(root / "draft", num_layers=1, seed=4),  # the same tokenizer, other weights
        "alien": build_random_llama(root / "alien", num_layers=1, vocab_size=320),  # another tokenizer
    }


@pytest.fixture(scope="module")
def target(models: dict[str, Path]) -> tuple[Any, Any]:
    return load(str(models["target"]))


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    cache = make_prompt_cache(model)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)]


def speculator(model: Any, source: Any, max_tokens: int, prompt: list[int] = PROMPT) -> Speculator:
    """As the serial lane makes one: the prompt prefilled but for its last token."""
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return Speculator(model, cache, list(prompt), Distribution(temp=0.0), [], source.drafter(cache), 4, max_tokens)


def run(spec: Speculator, n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        out += [t for t, _ in spec.next_tokens()]
    return out


def opened(value: str, target: tuple[Any, Any], models: dict[str, Path]) -> Any:
    model, tokenizer = target
    return open_draft(DraftConfig.parse(value), model, tokenizer, 384, 8, lambda path: load(path))


def test_the_target_as_its_own_draft_model_is_right_every_time(target: tuple[Any, Any], models: dict[str, Path]) -> None:
    truth = greedy(target[0], PROMPT, 30)
    spec = speculator(target[0], opened(str(models["target"]), target, models), 30)
    assert run(spec, 30) == truth
    assert spec.tally.proposed >= 20 and spec.tally.accepted == spec.tally.proposed


@pytest.mark.parametrize("draft", ["draft", "self:1", "self:3"])
def test_greedy_tokens_are_generate_steps_with_a_model_draft(target: tuple[Any, Any], models: dict[str, Path],
                                                              draft: str) -> None:
    truth = greedy(target[0], PROMPT, 40)
    value = str(models["draft"]) if draft == "draft" else draft
    spec = speculator(target[0], opened(value, target, models), 40)
    assert run(spec, 40) == truth
    assert spec.tally.proposed > 0 and spec.tally.accepted <= spec.tally.proposed


@pytest.mark.parametrize("after", [1, 7])
def test_a_self_draft_leaves_the_kv_as_it_found_it(target: tuple[Any, Any], models: dict[str, Path],
                                                  after: int) -> None:
    spec = speculator(target[0], opened("self:2", target, models), 40)
    out = run(spec, after)
    kv = spec.release()
    assert {c.offset for c in kv} == {len(PROMPT) + len(out) - 1}  # the drafting layers too


def test_the_draft_models_kv_keeps_the_prefix_the_next_request_shares(target: tuple[Any, Any],
                                                                       models: dict[str, Path]) -> None:
    source = opened(str(models["draft"]), target, models)
    first = speculator(target[0], source, 12)
    run(first, 12)
    drafter = source.drafter([])
    assert isinstance(drafter, ModelDrafter)
    fed: list[int] = []
    real = drafter._model
    drafter._model = lambda x, cache: (fed.append(x.shape[1]), real(x, cache=cache))[1]
    follow = [*first.tokens, 11, 12, 13]  # the next turn: the whole conversation and more
    second = speculator(target[0], source, 8, follow)
    # At least the first request's prompt was kept: only what came after it is fed (26 tokens otherwise).
    assert 0 < sum(fed) <= len(follow) - 1 - len(PROMPT), fed
    assert run(second, 8) == greedy(target[0], follow, 8)


def test_a_draft_model_of_another_tokenizer_is_refused(target: tuple[Any, Any], models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="does not share the model's tokenizer"):
        opened(str(models["alien"]), target, models)
    assert tokenizer_mismatch(target[1], load(str(models["draft"]))[1]) is None


@pytest.mark.parametrize("draft", ["draft", "self:2", "ngram"])
def test_the_kv_budget_counts_a_draft_models_kv_beside_the_models(models: dict[str, Path], draft: str) -> None:
    # Memory-bound sizing: the same room left, a token costs the model's KV and a draft model's.
    value = str(models["draft"]) if draft == "draft" else draft
    opts = GatewayOptions(memory_bytes=8 * 1024**3, batch=4, draft=DraftConfig.parse(value))
    loaded = open_model(lambda: LoadedModel(models["target"], "target"), opts)
    with_drafts = size_for(loaded, opts).memory_tokens
    source, loaded.drafts = loaded.drafts, None
    alone = size_for(loaded, opts).memory_tokens
    assert with_drafts is not None and alone is not None
    own = kv_bytes_per_token(loaded.config)
    if draft != "draft":  # a self-draft writes in the model's own KV, n-grams need none
        assert source.kv_bytes_per_token == 0 and with_drafts == alone
        return
    assert source.kv_bytes_per_token == own // 4  # one layer of the target's four, the same shape
    room = alone * own  # within a token's bytes of what both sizings had
    assert room - (own + own // 4) < with_drafts * (own + own // 4) <= room + own, (alone, with_drafts)


@pytest.mark.parametrize("value", ["self:4", "self:9"])
def test_a_self_draft_as_deep_as_the_model_is_refused(target: tuple[Any, Any], models: dict[str, Path],
                                                      value: str) -> None:
    with pytest.raises(ValueError, match="fewer layers than the model has"):
        opened(value, target, models)


@pytest.mark.parametrize("value", ["self:", "self:0", "self:x", ""])
def test_bad_draft_settings_say_what_is_wrong(value: str) -> None:
    with pytest.raises(ValueError, match=r"self:N|draft"):
        DraftConfig.parse(value)


# --- in a real engine process ---


@pytest.mark.parametrize("draft", ["draft", "self:2"])
def test_an_engine_drafting_from_a_model_answers_as_without_drafts(models: dict[str, Path], draft: str) -> None:
    from tests.support import openai_client, running_engine

    value = str(models["draft"]) if draft == "draft" else draft
    with (running_engine(models["target"], "target", "--draft", value, "--batch", "1") as engine,
          openai_client(engine) as client):
        def ask(drafts: bool) -> Any:
            return client.chat.completions.create(
                model="target", messages=[{"role": "user", "content": "The quick brown fox"}], max_tokens=40,
                temperature=0, extra_body={} if drafts else {"speculation": False})

        off, on = ask(False), ask(True)
        stats = engine.client.get("/admin/stats").json()
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.usage is not None and off.usage is not None
    assert on.usage.completion_tokens == off.usage.completion_tokens
    spec = (on.usage.model_extra or {}).get("speculation")
    assert spec is not None and 0 <= spec["accepted"] <= spec["proposed"] and spec["proposed"] > 0, on.usage
    assert "speculation" not in (off.usage.model_extra or {})
    assert stats["lanes"]["draft"] == (f"model:{value}" if draft == "draft" else value)
    assert stats["lanes"]["draft_proposed"] >= spec["proposed"]


def test_an_engine_given_a_draft_of_another_tokenizer_fails_to_load_saying_why(models: dict[str, Path]) -> None:
    from mlxd.protocol.exit_codes import ExitCode
    from tests.support import EngineProcess

    engine = EngineProcess(models["target"], "target", "--draft", str(models["alien"]))
    try:
        assert engine.proc.wait(60) == ExitCode.MODEL_LOAD_ERROR
        assert "does not share the model's tokenizer" in engine.log()
    finally:
        engine.stop()


@pytest.mark.parametrize("draft", ["self:2", "draft", "itself"])
def test_rows_decoding_together_draft_in_the_batch_and_answer_as_alone(models: dict[str, Path], draft: str) -> None:
    import concurrent.futures

    from tests.support import engine_client, lanes, running_engine

    prompts = ["The quick brown fox", "Paris is the capital", "Hello, world! How are", "Streaming text, stop"]
    value = {"draft": str(models["draft"]), "itself": str(models["target"])}.get(draft, draft)
    with running_engine(models["target"], "target", "--draft", value, "--batch", "4") as engine:
        def ask(prompt: str, drafts: bool) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, **({} if drafts else {"speculation": False})}
            with engine_client(engine) as c:
                resp = c.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return dict(resp.json())

        alone = [ask(p, False)["choices"][0]["text"] for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: ask(p, True), prompts))
        passes = lanes(engine)["draft_batch_passes"]
    assert [t["choices"][0]["text"] for t in together] == alone
    assert passes > 0
    proposed = sum(t["usage"]["speculation"]["proposed"] for t in together)
    accepted = sum(t["usage"]["speculation"]["accepted"] for t in together)
    assert proposed > 0
    if draft == "itself":  # the model drafting for itself, in the batch's own draft KV: right every time
        assert accepted == proposed, (accepted, proposed)
