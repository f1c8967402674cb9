"""The curve sampler through a real supervisor and engine (the tiny model): a drawn curve or the
HLG tone curve in place of temperature, in the serial lane and the batch lane, the config's
default and a request turning it off, the designer's /signal and /generate, the page's address,
and every bad curve a 400 naming the field."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from mlxd.protocol.curve import CURVE_UMIN, SIGNAL_BINS
from tests.support import NO_EOS, SupervisorProcess

IDENTITY = {"points": [[CURVE_UMIN, CURVE_UMIN], [0, 0]]}
FULL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}  # temperature 1.0 over the whole vocabulary
MSG = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def sup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    toml = (f'[models.tiny]\npath = "{tiny_model}"\n'
            f'[models.toned]\npath = "{tiny_model}"\n[models.toned.defaults.hlg]\nenabled = true\ntoe = 8\n')
    proc = SupervisorProcess(toml, tmp_path_factory.mktemp("curve") / "data").wait_up()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(sup: SupervisorProcess) -> openai.OpenAI:
    return sup.openai()


def answer(client: openai.OpenAI, model: str = "tiny", **extra: Any) -> str:
    sampling = {k: extra.pop(k) for k in ("temperature", "top_p") if k in extra}
    out = client.chat.completions.create(model=model, messages=MSG, max_tokens=24, seed=extra.pop("seed", 7),  # type: ignore[arg-type]
                                         extra_body={"logit_bias": NO_EOS, **extra}, **sampling)
    return out.choices[0].message.content or ""


def test_the_identity_curve_samples_as_temperature_one_with_the_same_seed(client: openai.OpenAI) -> None:
    for seed in (1, 2, 3):
        assert answer(client, seed=seed, curve=IDENTITY) == answer(client, seed=seed, **FULL)


def test_in_the_batch_too(client: openai.OpenAI) -> None:
    """Eight at once share batch steps; each row's curve is its own."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        curved = list(pool.map(lambda s: answer(client, seed=s, curve=IDENTITY), range(10, 18)))
        plain = list(pool.map(lambda s: answer(client, seed=s, **FULL), range(10, 18)))
    assert curved == plain
    assert len(set(curved)) > 1  # the seeds differ, and so do the samples


def test_a_shaped_curve_changes_the_samples_and_a_seed_repeats_them(client: openai.OpenAI) -> None:
    hot = {"points": [[CURVE_UMIN, -3.0], [0, 0]]}  # a tenth of the slope: nearly uniform over the vocabulary
    shaped = [answer(client, seed=s, curve=hot) for s in (4, 4)]
    assert shaped[0] == shaped[1]
    assert shaped[0] != answer(client, seed=4, curve=IDENTITY)


def test_a_curve_replaces_temperature(client: openai.OpenAI) -> None:
    assert answer(client, seed=5, curve=IDENTITY, temperature=0.0) == answer(client, seed=5, curve=IDENTITY)


def test_hlg_knobs_by_request_and_by_the_models_default(client: openai.OpenAI) -> None:
    """`toned` is the same weights with `[models.toned.defaults.hlg] enabled, toe = 8`."""
    toned = {"enabled": True, "toe": 8}
    assert answer(client, "toned", seed=6) == answer(client, seed=6, hlg=toned)
    assert answer(client, "toned", seed=6, hlg={"toe": 0, "shoulder": 0}) == answer(client, seed=6, **FULL)  # identity
    assert answer(client, "toned", seed=6, hlg={"enabled": False}, **FULL) == answer(client, seed=6, **FULL)
    assert answer(client, seed=6, hlg={"enabled": True}) != answer(client, seed=6, **FULL)


@pytest.mark.parametrize(("extra", "param"), [
    ({"curve": {"points": [[-10, -10], [-5, -12], [0, 0]]}}, "curve"),
    ({"curve": {"points": [[-10, -10]]}}, "curve.points"),
    ({"curve": {"points": [[-50, -10], [0, 0]]}}, "curve"),
    ({"curve": "steep"}, "curve"),
    ({"curve": {"points": [[-10, "a"], [0, 0]]}}, "curve.points[0][1]"),
    ({"hlg": {"width": 0}}, "hlg.width"),
    ({"hlg": {"toe": -1}}, "hlg.toe"),
    ({"hlg": {"knee": 2}}, "hlg"),
])
def test_bad_curves_are_400_naming_the_field(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, extra_body=extra)  # type: ignore[arg-type]
    body: Any = err.value.body
    assert body["param"] == param, body
    if "-12" in str(extra):
        assert "not monotone" in body["message"]


def test_signal_bins_the_next_tokens_log_probabilities(sup: SupervisorProcess) -> None:
    out = sup.client.post("/signal", json={"model": "tiny", "prompt": "Hello"}).json()
    assert len(out["bins"]) == SIGNAL_BINS and out["umin"] == CURVE_UMIN
    assert sum(out["bins"]) == out["vocab"] > 0
    assert out["prompt_tokens"] > 1
    logprobs = [t["logprob"] for t in out["top"]]
    assert logprobs == sorted(logprobs, reverse=True) and all(lp <= 0 for lp in logprobs)


def test_generate_samples_under_a_curve_and_under_the_models_own_sampling(sup: SupervisorProcess) -> None:
    body = {"model": "tiny", "prompt": "Hello", "curve": IDENTITY, "n": 3, "max_tokens": 8, "seed": 40}
    first = sup.client.post("/generate", json=body).json()
    assert first["mode"] == "curve" and first["n"] == 3 and first["seed"] == 40
    assert len(first["samples"]) == 3 and all(isinstance(s["junk"], bool) for s in first["samples"])
    assert sup.client.post("/generate", json=body).json()["samples"] == first["samples"]  # the seeds repeat it
    default = sup.client.post("/generate", json={**body, "default": True}).json()
    assert default["mode"] == "default" and default["recipe"]["temperature"] == 0.8  # mlxd's default sampling
    assert sup.client.post("/generate", json={"model": "tiny", "prompt": "Hi", "hlg": {"enabled": True}, "n": 1,
                                              "max_tokens": 4}).json()["mode"] == "hlg"


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/generate", {"prompt": "x", "curve": {"points": [[-5, 0], [-1, -1]]}}, 400),
    ("/generate", {"prompt": "x", "n": 9}, 400),
    ("/generate", {"prompt": "x", "max_tokens": 0}, 400),
    ("/generate", {"prompt": 3}, 400),
    ("/signal", {"prompt": ["x"]}, 400),
    ("/signal", {"model": "nope", "prompt": "x"}, 404),
])
def test_the_designers_calls_refuse_bad_input(sup: SupervisorProcess, path: str, body: dict[str, Any],
                                              status: int) -> None:
    resp = sup.client.post(path, json={"model": "tiny", **body})
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["message"]
    assert sup.client.post(path, content=b"{not json").status_code == 400


def test_the_designer_page_is_a_view_of_the_web_app(sup: SupervisorProcess) -> None:
    resp = sup.client.get("/curves", follow_redirects=False)
    assert resp.status_code == 302 and resp.headers["location"] == "/#curves"
    page = sup.client.get("/").text
    assert 'id="view-curves"' in page and 'data-view="curves"' in page
    assert "openCurves" in sup.client.get("/ui/curves.js").text
