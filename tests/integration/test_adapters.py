"""LoRA adapters through a real supervisor on SmolLM2: found in the data dir, picked per request
by `adapter` or a `model:adapter` id from the openai, anthropic and Responses APIs, a default
per model from the config, loaded and unloaded by /v1/adapters and `mlxd adapters`, and loaded
again after the engine crashed (supervisor/adapters.py, engines/adapter_mounts.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import psutil
import pytest

from tests.support import SupervisorProcess, cli_env, mlxd, serving, wait_for

QUESTION = "Name three kitchen tools."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def made(smollm2: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapter dirs: two for SmolLM2, one for the tiny model, one in a dir of its own elsewhere."""
    from mlxd.engine.models.random_adapter import build_random_adapter

    root = tmp_path_factory.mktemp("made-adapters")
    return {
        "terse": build_random_adapter(smollm2, root / "terse", rank=8, seed=1, strength=0.035),
        "dora": build_random_adapter(smollm2, root / "dora", rank=4, seed=3, dora=True),
        "tinyish": build_random_adapter(tiny_model, root / "tinyish", rank=2, seed=4),
        "elsewhere": build_random_adapter(smollm2, root / "elsewhere", rank=4, seed=5, strength=0.05),
    }


@pytest.fixture(scope="module")
def sup(smollm2: Path, made: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    """A supervisor serving SmolLM2 as `smol` whose requests run under `terse` unless they say
    otherwise; terse, dora and tinyish in its data dir's adapters/."""
    data = tmp_path_factory.mktemp("adapters-data")
    for name in ("terse", "dora", "tinyish"):
        shutil.copytree(made[name], data / "adapters" / name)
    with serving(smollm2, "smol", data, model_config='adapter = "terse"') as proc:
        yield proc


def chat(sup: SupervisorProcess, model: str = "smol", **extra: Any) -> str:
    answer = sup.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0,
        **({"extra_body": extra} if extra else {}))
    return str(answer.choices[0].message.content)


@pytest.fixture(scope="module")
def answers(sup: SupervisorProcess) -> dict[str, str]:
    """The greedy chat answer under each: the base model, terse, dora."""
    return {name: chat(sup, adapter=name) for name in ("none", "terse", "dora")}


def test_the_configured_default_adapter_is_used_unless_a_request_names_another(
    sup: SupervisorProcess, answers: dict[str, str]
) -> None:
    assert len(set(answers.values())) == 3, answers
    assert chat(sup) == answers["terse"]
    assert chat(sup, "smol:dora") == answers["dora"]
    assert chat(sup, "smol:none") == answers["none"]
    assert chat(sup, "smol:dora", adapter="none") == answers["none"]  # the field wins over the id


def test_anthropic_and_responses_requests_pick_adapters_too(sup: SupervisorProcess, answers: dict[str, str]) -> None:
    message = sup.anthropic().messages.create(
        model="smol", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}],
        extra_body={"adapter": "dora", "temperature": 0})  # the SDK no longer types sampling fields
    assert message.content[0].text == answers["dora"]  # type: ignore[union-attr]
    via_id = sup.anthropic().messages.create(
        model="smol:none", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0})
    assert via_id.content[0].text == answers["none"]  # type: ignore[union-attr]
    response = sup.openai().responses.create(model="smol", input=QUESTION, max_output_tokens=MAX_TOKENS,
                                             extra_body={"adapter": "dora", "temperature": 0})
    assert response.output_text == answers["dora"]


def test_adapters_are_listed_with_where_they_are_loaded(sup: SupervisorProcess, answers: dict[str, str]) -> None:
    listed = {a["id"]: a for a in sup.client.get("/v1/adapters").json()["data"]}
    assert {"terse", "dora", "tinyish"} <= set(listed)
    assert listed["terse"]["loaded_on"] == ["smol"] and listed["dora"]["loaded_on"] == ["smol"]
    assert listed["tinyish"]["loaded_on"] == [] and listed["dora"]["kind"] == "dora"
    for_smol = {a["id"] for a in sup.client.get("/v1/adapters/available", params={"model": "smol"}).json()["data"]}
    assert {"terse", "dora"} <= for_smol and "tinyish" not in for_smol
    table = mlxd("adapters", "--url", sup.url, env=cli_env())
    assert table.returncode == 0 and "terse" in table.stdout and "smol" in table.stdout, table.stderr


def test_unknown_adapters_and_ones_for_another_model_are_400s_in_each_api(sup: SupervisorProcess) -> None:
    with pytest.raises(openai.BadRequestError) as unknown:
        chat(sup, adapter="nosuch")
    assert unknown.value.code == "adapter_not_found" and "nosuch" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as other:
        chat(sup, "smol:tinyish")
    assert other.value.code == "adapter_base_mismatch" and "tinyish" in other.value.message
    with pytest.raises(openai.NotFoundError):
        chat(sup, "nosuch:terse")
    with pytest.raises(anthropic.BadRequestError) as in_anthropic:
        sup.anthropic().messages.create(model="smol:nosuch", max_tokens=8,
                                        messages=[{"role": "user", "content": QUESTION}])
    assert in_anthropic.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    bad_type = sup.client.post("/v1/chat/completions", json={"model": "smol", "adapter": 3,
                                                             "messages": [{"role": "user", "content": "x"}]})
    assert bad_type.status_code == 400 and "adapter" in bad_type.json()["error"]["message"]
    assert chat(sup, adapter="terse")  # nothing lost


def test_an_adapter_dir_elsewhere_is_loaded_by_path_and_unloaded(
    sup: SupervisorProcess, made: dict[str, Path], answers: dict[str, str]
) -> None:
    loaded = mlxd("adapters", "load", str(made["elsewhere"]), "--id", "far", "--url", sup.url, "--json", env=cli_env())
    assert loaded.returncode == 0, loaded.stderr
    card = json.loads(loaded.stdout)
    assert (card["id"], card["loaded_on"], card["source"]) == ("far", ["smol"], "registered")
    far = chat(sup, adapter="far")
    assert far not in answers.values()
    assert sup.engine_stats("smol")["lanes"]["adapters"] >= 3
    gone = mlxd("adapters", "unload", "far", "--url", sup.url, env=cli_env())
    assert gone.returncode == 0 and "unloaded from smol" in gone.stdout, gone.stderr
    again = mlxd("adapters", "unload", "far", "--url", sup.url, env=cli_env())
    assert again.returncode != 0 and "not loaded" in again.stderr
    bad = sup.client.post("/v1/adapters", json={"path": str(made["elsewhere"].parent / "nope")})
    assert bad.status_code == 400 and "not an adapter dir" in bad.json()["error"]["message"]
    mismatch = sup.client.post("/v1/adapters", json={"id": "tinyish", "model": "smol"})
    assert mismatch.status_code == 400 and mismatch.json()["error"]["code"] == "adapter_base_mismatch"
    assert chat(sup, adapter="far") == far  # named again: loaded again on first use


def test_after_an_engine_crash_its_adapters_are_loaded_again(sup: SupervisorProcess, answers: dict[str, str]) -> None:
    def pid() -> int | None:
        rows = sup.client.get("/admin/engines").json()["data"]
        return next((r["pid"] for r in rows if r["model"] == "smol"), None)

    before = pid()
    assert before is not None
    psutil.Process(before).kill()
    wait_for(lambda: pid() != before, 30)  # the supervisor saw it die; the next request starts another
    assert chat(sup, adapter="dora") == answers["dora"]
    assert chat(sup) == answers["terse"]


def test_adapters_a_request_loaded_count_in_the_models_memory_booking(
    sup: SupervisorProcess, answers: dict[str, str]
) -> None:
    def estimate() -> int:
        rows = sup.client.get("/admin/engines").json()["data"]
        return int(next(r["memory_estimate_bytes"] for r in rows if r["model"] == "smol"))

    assert chat(sup, adapter="dora") == answers["dora"]  # loaded on first use (not kept)
    with_dora, engine_bytes = estimate(), sup.engine_stats("smol")["lanes"]["adapter_bytes"]
    assert sup.client.delete("/v1/adapters/dora").status_code == 200
    without = estimate()
    dora_bytes = engine_bytes - sup.engine_stats("smol")["lanes"]["adapter_bytes"]
    assert dora_bytes > 0 and with_dora - without == dora_bytes  # what the engine says it holds
    assert chat(sup, adapter="dora") == answers["dora"]
    assert estimate() == with_dora  # loaded again, booked again
