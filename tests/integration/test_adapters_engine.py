"""LoRA adapters in a real engine on SmolLM2: mounted through /admin/adapters, chosen per request,
rows under different adapters decoding in one batched step (models/adapter_bank.py).

Adapters are mlx-lm's format with random B (models/random_adapter.py), so each one changes the
greedy answer. What an adapter's answer must be is what mlx-lm gives with its own LoRA layers
(`load_adapters`) on the same model; a stack of two is mlx-lm's answer with the first fused
into the weights and the second loaded on top.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    EngineProcess,
    complete,
    engine_client,
    lanes,
    openai_client,
    running_engine,
    start_in_one_turn,
    text_of,
)

PROMPT = "The three most useful kitchen tools are"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapter_dirs(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mlxd.engine.models.random_adapter import build_random_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        "terse": build_random_adapter(smollm2, root / "terse", rank=8, seed=1, strength=0.035),
        "poet": build_random_adapter(smollm2, root / "poet", rank=4, seed=2, keys=("self_attn.k_proj", "mlp.up_proj"),
                                     strength=0.08),
        "dora": build_random_adapter(smollm2, root / "dora", rank=4, seed=3, dora=True),
    }


@pytest.fixture(scope="module")
def reference(smollm2: Path, adapter_dirs: dict[str, Path]) -> dict[str, str]:
    """mlx-lm's own greedy answers to PROMPT: the base model, each adapter, and terse+poet."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import generate_step
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    from mlxd.engine.gpu.sequence import keep_first_space

    def answer(*adapters: Path, fuse_first: bool = False) -> str:
        model, tokenizer = load(str(smollm2))
        for i, path in enumerate(adapters):
            load_adapters(model, str(path))
            if fuse_first and i == 0:
                fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
                model.update_modules(_unflatten(fused))
        assert isinstance(model, nn.Module)
        # generate()'s greedy tokens, as a text completion answers them: their first space kept
        detok = tokenizer.detokenizer
        keep_first_space(detok)
        for token, _ in generate_step(mx.array(tokenizer.encode(PROMPT)), model, max_tokens=MAX_TOKENS):
            if int(token) in tokenizer.eos_token_ids:
                break
            detok.add_token(int(token))
        detok.finalize()
        return str(detok.text)

    return {
        "none": answer(),
        **{name: answer(path) for name, path in adapter_dirs.items()},
        "poet+terse": answer(adapter_dirs["terse"], adapter_dirs["poet"], fuse_first=True),
    }


def _unflatten(pairs: list[tuple[str, Any]]) -> Any:
    from mlx.utils import tree_unflatten

    return tree_unflatten(pairs)


@pytest.fixture(scope="module")
def smol(smollm2: Path, adapter_dirs: dict[str, Path]) -> Iterator[EngineProcess]:
    """SmolLM2 with four batch rows and every adapter mounted; a KV budget under the window, so
    start_in_one_turn's blocker can hold all of it."""
    with running_engine(smollm2, "smol", "--batch", "4", "--kv-budget-tokens", "4096") as engine:
        with engine_client(engine) as c:
            for name, path in adapter_dirs.items():
                resp = c.post("/admin/adapters", json={"id": name, "path": str(path)})
                assert resp.status_code == 200, resp.text
        yield engine


def ask(engine: EngineProcess, adapter: str | None, prompt: str = PROMPT, **body: Any) -> dict[str, Any]:
    extra = {"adapter": adapter} if adapter is not None else {}
    return complete(engine, prompt, max_tokens=MAX_TOKENS, **extra, **body)


def test_mounted_adapters_are_listed_with_their_shape(smol: EngineProcess, adapter_dirs: dict[str, Path]) -> None:
    with engine_client(smol) as c:
        listed = {a["id"]: a for a in c.get("/admin/adapters").json()["adapters"]}
    assert set(listed) == set(adapter_dirs)
    assert (listed["terse"]["kind"], listed["terse"]["rank"], listed["terse"]["layers"]) == ("lora", 8, 30)
    assert listed["dora"]["kind"] == "dora" and listed["poet"]["rank"] == 4
    assert all(a["size_bytes"] > 0 for a in listed.values())


def test_each_adapter_answers_as_mlx_lm_with_its_lora_layers(smol: EngineProcess, reference: dict[str, str]) -> None:
    assert len(set(reference.values())) == len(reference), "every adapter must change the answer"
    for name in ("none", "terse", "poet", "dora", "poet+terse"):
        assert text_of(ask(smol, name)) == reference[name], name
    assert text_of(ask(smol, None)) == reference["none"]
    assert text_of(ask(smol, "terse+poet")) == reference["poet+terse"]  # a stack is a set: order is no matter


def test_rows_under_different_adapters_share_batched_steps_and_each_answers_as_alone(
    smol: EngineProcess, reference: dict[str, str]
) -> None:
    names = ["terse", "none", "dora", "poet+terse"]
    before = lanes(smol)["adapter_mixed_passes"]
    futures = start_in_one_turn(smol, [functools.partial(ask, smol, n) for n in names])
    answers = [f.result() for f in futures]
    assert [text_of(a) for a in answers] == [reference[n] for n in names]
    # They ran as rows of one forward pass from their last prompt token (its pass gives the first
    # token) through every decode step while at least two of them were left.
    second_longest = sorted(a["usage"]["completion_tokens"] for a in answers)[-2]
    assert lanes(smol)["adapter_mixed_passes"] - before >= second_longest


@pytest.mark.slow  # about 14 s: `make test` stays under 10 minutes (CI runs the slow ones too)
def test_the_prompt_cache_keeps_each_adapters_kv_apart(smol: EngineProcess) -> None:
    prompt = "A long list of facts about rivers: " + ", ".join(f"river {i} is wide" for i in range(40))
    first = ask(smol, "terse", prompt)
    again = ask(smol, "terse", prompt)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert text_of(again) == text_of(first)
    other = ask(smol, "poet", prompt)  # the same tokens under another adapter: none of terse's KV
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    base = ask(smol, "none", prompt)
    assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert text_of(ask(smol, "poet", prompt)) == text_of(other)  # now from poet's own entry


def test_the_openai_sdk_picks_an_adapter_by_extra_body(smol: EngineProcess, reference: dict[str, str]) -> None:
    with openai_client(smol) as sdk:
        got = sdk.completions.create(model="smol", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"adapter": "dora"})
    assert got.choices[0].text == reference["dora"]


def test_unknown_and_unfit_adapters_are_400s_naming_them(
    smol: EngineProcess, tiny_model: Path, tmp_path: Path
) -> None:
    from mlxd.engine.models.random_adapter import build_random_adapter

    unknown = ask(smol, "missing")
    assert unknown["status"] == 400 and "'missing'" in unknown["error"]["message"]
    assert (unknown["error"]["param"], unknown["error"]["code"]) == ("adapter", "adapter_not_found")
    stacked = ask(smol, "dora+terse")
    assert stacked["status"] == 400 and "DoRA" in stacked["error"]["message"]
    other_model = build_random_adapter(tiny_model, tmp_path / "tiny-adapter", rank=2)
    with engine_client(smol) as c:
        wrong = c.post("/admin/adapters", json={"id": "wrong", "path": str(other_model)})
        assert wrong.status_code == 400 and "do not fit" in wrong.json()["error"]["message"], wrong.text
        nowhere = c.post("/admin/adapters", json={"id": "nowhere", "path": str(tmp_path / "nope")})
        assert nowhere.status_code == 400 and "not an adapter dir" in nowhere.json()["error"]["message"]
        bad_id = c.post("/admin/adapters", json={"id": "a+b", "path": str(other_model)})
        assert bad_id.status_code == 400
        assert c.delete("/admin/adapters/missing").status_code == 404
        assert {a["id"] for a in c.get("/admin/adapters").json()["adapters"]} == {"terse", "poet", "dora"}
    assert ask(smol, "terse")["status"] == 200  # nothing lost


def test_an_unloaded_adapter_is_refused_and_can_be_loaded_again(
    smol: EngineProcess, adapter_dirs: dict[str, Path], reference: dict[str, str]
) -> None:
    with engine_client(smol) as c:
        assert c.delete("/admin/adapters/poet").json() == {"id": "poet", "unloaded": True}
        assert ask(smol, "poet")["status"] == 400
        assert c.post("/admin/adapters", json={"id": "poet", "path": str(adapter_dirs["poet"])}).status_code == 200
    assert text_of(ask(smol, "poet")) == reference["poet"]


def test_a_malformed_mount_body_is_a_400(smol: EngineProcess) -> None:
    with engine_client(smol) as c:
        for body in (b"{", b'{"id": 3, "path": "x"}', b'{"id": "x"}'):
            resp = c.post("/admin/adapters", content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400, body


def test_with_merging_on_a_lone_adapter_runs_merged_and_answers_the_same(
    smollm2: Path, adapter_dirs: dict[str, Path], reference: dict[str, str]
) -> None:
    with running_engine(smollm2, "merging", "--adapter-merge", "on") as engine, engine_client(engine) as c:
        assert c.post("/admin/adapters", json={"id": "dora", "path": str(adapter_dirs["dora"])}).status_code == 200
        first = ask(engine, "dora")  # merged once it had every row for MERGE_AFTER_PASSES passes
        assert lanes(engine)["adapter_merged_bytes"] > 0
        second = ask(engine, "dora")
        assert [text_of(first), text_of(second)] == [reference["dora"]] * 2
        assert text_of(ask(engine, "none")) == reference["none"]  # the base model's layers are untouched
        assert c.delete("/admin/adapters/dora").status_code == 200
        assert lanes(engine)["adapter_merged_bytes"] == 0
