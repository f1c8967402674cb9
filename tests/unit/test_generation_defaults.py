"""A model's generation_config.json: sane defaults are used, absurd ones are dropped; what
neither a request nor its model sets is mlxd's (protocol/sampling.py)."""

from __future__ import annotations

from pathlib import Path

from mlxd.engine.http.openai_requests import sampling_params
from mlxd.engine.models.loaded_model import generation_defaults
from mlxd.protocol import openai as oa
from mlxd.protocol import sampling
from mlxd.protocol.sampling import Defaults


def defaults(tmp_path: Path, text: str) -> dict[str, float]:
    (tmp_path / "generation_config.json").write_text(text)
    return generation_defaults(tmp_path)


def test_sane_values_are_kept(tmp_path: Path) -> None:
    got = defaults(tmp_path, '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "repetition_penalty": 1.1}')
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "min_p": 0.0, "repetition_penalty": 1.1}


def test_infinite_nan_huge_and_wrong_types_are_dropped(tmp_path: Path) -> None:
    text = '{"temperature": Infinity, "top_p": NaN, "top_k": 1e30, "min_p": -1, "repetition_penalty": true}'
    assert defaults(tmp_path, text) == {}


def test_do_sample_false_means_greedy_whatever_else_the_file_lists(tmp_path: Path) -> None:
    text = '{"do_sample": false, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}'
    assert defaults(tmp_path, text) == {"temperature": 0.0, "repetition_penalty": 1.05}
    assert params(defaults(tmp_path, text))[0] == 0.0
    assert params(defaults(tmp_path, text), temperature=0.7)[0] == 0.7  # a request's own value wins
    assert defaults(tmp_path, '{"do_sample": false}') == {"temperature": 0.0}
    # do_sample true, or anything but the JSON false, changes nothing
    assert defaults(tmp_path, '{"do_sample": true, "temperature": 0.6}') == {"temperature": 0.6}
    assert defaults(tmp_path, '{"do_sample": 0, "temperature": 0.6}') == {"temperature": 0.6}


def test_not_an_object_or_not_json(tmp_path: Path) -> None:
    assert defaults(tmp_path, "[1, 2]") == {}
    assert defaults(tmp_path, "{") == {}
    assert generation_defaults(tmp_path / "missing") == {}


class Model:
    """What sampling_params reads of a loaded model."""

    def __init__(self, defaults: dict[str, float], vocab_size: int = 49152) -> None:
        self.generation_defaults = defaults
        self.configured = Defaults()  # mlxd's config sets none here
        self.vocab_size = vocab_size


def params(model: dict[str, float], **request: float) -> tuple[float, float, int, float]:
    req = oa.SamplingFields(**request)  # type: ignore[arg-type]
    got = sampling_params(req, Model(model))  # type: ignore[arg-type]
    return got.temperature, got.top_p, got.top_k, got.min_p


def test_a_request_and_a_model_that_set_nothing_get_mlxds_defaults() -> None:
    assert params({}) == (0.8, 0.95, 40, 0.05)
    assert sampling.in_use({}) == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}


def test_the_models_values_come_before_mlxds_and_the_requests_before_both() -> None:
    smollm2 = {"temperature": 0.2, "top_p": 0.9}
    assert params(smollm2) == (0.2, 0.9, 40, 0.05)  # what it does not set is still truncated
    assert params(smollm2, temperature=0.0, top_k=0, min_p=0.0) == (0.0, 0.9, 0, 0.0)  # 0 is a value, not unset
    assert params({}, temperature=1.0, top_p=1.0) == (1.0, 1.0, 40, 0.05)
    assert sampling.in_use(smollm2) == {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05}


def test_a_top_k_as_large_as_the_vocabulary_is_no_top_k() -> None:
    got = sampling_params(oa.SamplingFields(top_k=100), Model({}, vocab_size=100))  # type: ignore[arg-type]
    assert got.top_k == 0


def test_the_configs_defaults_come_between_the_request_and_the_models_file() -> None:
    model = Model({"temperature": 0.2, "top_p": 0.9})
    model.configured = Defaults(temperature=0.6, top_k=7)
    got = sampling_params(oa.SamplingFields(), model)  # type: ignore[arg-type]
    assert (got.temperature, got.top_p, got.top_k, got.min_p) == (0.6, 0.9, 7, 0.05)
    own = sampling_params(oa.SamplingFields(temperature=1.1), model)  # type: ignore[arg-type]
    assert own.temperature == 1.1 and own.top_k == 7
    assert Defaults(temperature=0.1).over(Defaults(temperature=0.5, max_tokens=9)) == Defaults(temperature=0.1,
                                                                                                max_tokens=9)
