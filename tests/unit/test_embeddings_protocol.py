"""Embeddings without a model: the request's inputs, pooling configs and arithmetic, batch
grouping, and Ollama's embed mapping (protocol/embeddings.py, engine/embed/pooling.py and
gateway.batches, protocol/ollama*.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import mlx.core as mx
import msgspec
import numpy as np
import pytest

from mlxd.engine.embed import pooling
from mlxd.engine.embed.gateway import batches
from mlxd.protocol import ollama, ollama_answers
from mlxd.protocol.embeddings import MAX_INPUTS, EmbeddingRequest, encode_vector, inputs_of
from mlxd.protocol.errors import APIError


def req(value: object, **kw: object) -> EmbeddingRequest:
    return msgspec.json.decode(json.dumps({"model": "m", "input": value, **kw}), type=EmbeddingRequest)


def test_inputs_take_every_shape_openai_allows() -> None:
    assert inputs_of(req("a b")) == ["a b"]
    assert inputs_of(req(["a", "b"])) == ["a", "b"]
    assert inputs_of(req([5, 6, 7])) == [[5, 6, 7]]  # one input of token ids
    assert inputs_of(req([[5, 6], [7]])) == [[5, 6], [7]]


@pytest.mark.parametrize(("value", "says"), [
    ([], "must not be empty"), ("", "input is empty"), (["a", ""], "input[1] is empty"), ([[1], []], "input[1]"),
    (["a", 1], "not a mix"), ([[1], "a"], "not a mix"), (["x"] * (MAX_INPUTS + 1), f"at most {MAX_INPUTS}"),
])
def test_bad_inputs_are_a_400_naming_input(value: object, says: str) -> None:
    with pytest.raises(APIError) as err:
        inputs_of(req(value))
    assert err.value.status == 400 and err.value.param == "input" and says in err.value.message


@pytest.mark.parametrize("body", [{"model": "m"}, {"model": "m", "input": 3}, {"model": "m", "input": "a", "dimensions": 0},
                                  {"model": "m", "input": "a", "encoding_format": "hex"}, {"model": "m", "input": [1.5]}])
def test_wrong_types_do_not_decode(body: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(json.dumps(body), type=EmbeddingRequest)


def test_base64_is_little_endian_float32_as_openai_sdks_unpack_it() -> None:
    vector = np.array([0.5, -1.25, 3.0], dtype="<f4")
    packed = encode_vector(vector.tobytes(), "base64")
    assert isinstance(packed, str)
    assert np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist() == [0.5, -1.25, 3.0]
    assert ollama_answers.floats(packed) == [0.5, -1.25, 3.0]


def write(path: Path, modules: list[dict[str, str]] | None, config: dict[str, object] | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if modules is not None:
        (path / "modules.json").write_text(json.dumps(modules))
    if config is not None:
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return path


POOL_MODULE = {"path": "1_Pooling", "type": pooling.POOLING}


def test_pooling_is_read_from_the_sentence_transformers_config(tmp_path: Path) -> None:
    assert pooling.read(write(tmp_path / "a", [POOL_MODULE], {"pooling_mode_cls_token": True})).modes == ("cls",)
    both = pooling.read(write(tmp_path / "b", [POOL_MODULE], {"pooling_mode_mean_tokens": True,
                                                            "pooling_mode_cls_token": True}))
    assert both.modes == ("cls", "mean")  # sentence-transformers' order, concatenated
    assert pooling.read(write(tmp_path / "c", None, {"pooling_mode_lasttoken": True})).modes == ("lasttoken",)
    # No config, or a Dense projection after pooling: the model family's own pooling.
    assert pooling.read(write(tmp_path / "d", None, None)).modes == ()
    dense = [POOL_MODULE, {"path": "2_Dense", "type": pooling.DENSE}]
    assert pooling.read(write(tmp_path / "e", dense, {"pooling_mode_mean_tokens": True})).modes == ()
    with pytest.raises(pooling.PoolingError, match="weightedmean"):
        pooling.read(write(tmp_path / "f", [POOL_MODULE], {"pooling_mode_weightedmean_tokens": True}))


def test_pooling_sees_only_each_rows_own_tokens() -> None:
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, 4, 3)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=np.int32)
    hidden[1, 2:] = 1000.0  # padding: none of it may show
    lengths = mask.sum(axis=1)
    out = {m: np.array(pooling.pool(mx.array(hidden), mx.array(mask), mx.array(lengths), (m,)))
           for m in pooling.ORDER}
    np.testing.assert_allclose(out["cls"], hidden[:, 0], rtol=1e-6)
    np.testing.assert_allclose(out["mean"][1], hidden[1, :2].mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(out["max"][1], hidden[1, :2].max(axis=0), rtol=1e-6)
    np.testing.assert_allclose(out["lasttoken"], np.stack([hidden[0, 3], hidden[1, 1]]), rtol=1e-6)
    unit = np.array(pooling.unit(mx.array(np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32))))
    np.testing.assert_allclose(unit, [[0.6, 0.8], [0.0, 0.0]], rtol=1e-6)


def test_batches_group_rows_of_like_length_within_the_token_bound() -> None:
    lengths = [5, 100, 7, 100, 6, 3000]
    groups = batches(lengths, max_tokens=400, max_rows=3)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups[0] == [5]  # longer than the bound: alone
    for g in groups:
        assert len(g) <= 3 and (len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 400)
    assert any({1, 3} <= set(g) for g in groups)  # the two 100s share a forward


def test_ollama_embed_maps_to_openais_and_back() -> None:
    new = msgspec.json.decode(b'{"model": "e", "input": ["a", "b"], "dimensions": 8}', type=ollama.EmbedRequest)
    assert ollama.embed_body(new, legacy=False) == {"model": "e", "input": ["a", "b"], "truncate": True,
                                                    "encoding_format": "base64", "dimensions": 8}
    old = msgspec.json.decode(b'{"model": "e", "prompt": "a", "truncate": false}', type=ollama.EmbedRequest)
    assert ollama.embed_body(old, legacy=True) == {"model": "e", "input": "a", "truncate": False,
                                                   "encoding_format": "base64"}
    assert ollama.embed_body(msgspec.json.decode(b'{"model": "e"}', type=ollama.EmbedRequest), legacy=False) is None
    packed = [base64.b64encode(np.array(v, dtype="<f4").tobytes()).decode() for v in ([1.0, 0.0], [0.0, 1.0])]
    data = {"data": [{"index": 1, "embedding": packed[1]}, {"index": 0, "embedding": packed[0]}],
            "usage": {"prompt_tokens": 4}}
    answer = ollama_answers.embed_answer(data, "e", legacy=False, started=0.0)
    assert isinstance(answer, ollama_answers.EmbedAnswer)
    assert answer.embeddings == [[1.0, 0.0], [0.0, 1.0]] and answer.prompt_eval_count == 4 and answer.model == "e"
    legacy = ollama_answers.embed_answer(data, "e", legacy=True, started=0.0)
    assert isinstance(legacy, ollama_answers.LegacyEmbedding) and legacy.embedding == [1.0, 0.0]
