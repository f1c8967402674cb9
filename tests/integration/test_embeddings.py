"""Embeddings through a real supervisor and real engines: a random BERT (an encoder, `cls`
pooling) and a random Qwen3 embedder (a decoder, `lasttoken` pooling), both built with
mlx-embeddings' classes and sentence-transformers files, beside a tiny chat model. With the
official `openai` and `ollama` clients: the vectors the pooling says, the same for a text alone
and in a batch, token ids and texts alike, `dimensions`, base64, the window, and every bad
input a 400 in the caller's shape."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import ollama
import openai
import pytest

from tests.support import SupervisorProcess

BERT, QWEN, CHAT = "bert", "qemb", "tiny"
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. Paris is the capital of France.", "0123"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mlxd.engine.models.random_embedder import build_random_bert, build_random_qwen3_embedder

    root = tmp_path_factory.mktemp("embedders")
    return {BERT: build_random_bert(root / BERT, pooling="cls", context=64),
            QWEN: build_random_qwen3_embedder(root / QWEN)}


@pytest.fixture(scope="module")
def sup(models: dict[str, Path], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[SupervisorProcess]:
    toml = "".join(f'[models.{name}]\npath = "{path}"\n' for name, path in {**models, CHAT: tiny_model}.items())
    proc = SupervisorProcess(toml, tmp_path_factory.mktemp("emb") / "data").wait_up()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(sup: SupervisorProcess) -> openai.OpenAI:
    return sup.openai()


def vectors(client: openai.OpenAI, model: str, value: Any, **kw: Any) -> np.ndarray:
    answer = client.embeddings.create(model=model, input=value, **kw)
    assert [d.index for d in answer.data] == list(range(len(answer.data)))
    return np.array([d.embedding for d in answer.data], dtype=np.float32)


def direct(path: Path, ids: list[int], mode: str) -> np.ndarray:
    """The model run here, in this process, on one row, pooled as `mode` says, made unit length."""
    import mlx.core as mx
    import mlx_embeddings.utils as meu

    model = meu.load_model(path)
    hidden = np.array(model(mx.array([ids]), attention_mask=mx.array([[1] * len(ids)])).last_hidden_state)[0]
    vector = hidden[0] if mode == "cls" else hidden[-1]
    return vector / np.linalg.norm(vector)


def token_ids(path: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids)


@pytest.mark.parametrize(("model", "mode"), [(BERT, "cls"), (QWEN, "lasttoken")])
def test_vectors_are_the_models_pooled_as_its_files_say(client: openai.OpenAI, models: dict[str, Path],
                                                       model: str, mode: str) -> None:
    got = vectors(client, model, TEXTS[1])
    ids = token_ids(models[model], TEXTS[1])
    np.testing.assert_allclose(got[0], direct(models[model], ids, mode), atol=1e-5)
    assert abs(float(np.linalg.norm(got[0])) - 1.0) < 1e-5
    answer = client.embeddings.create(model=model, input=TEXTS[1])
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == len(ids) and answer.model == model


@pytest.mark.parametrize("model", [BERT, QWEN])
def test_a_text_alone_and_in_a_batch_is_the_same_vector(client: openai.OpenAI, model: str) -> None:
    batch = vectors(client, model, TEXTS)
    assert batch.shape == (3, 64)
    for i, text in enumerate(TEXTS):
        np.testing.assert_allclose(vectors(client, model, text)[0], batch[i], atol=1e-5)
    assert not np.allclose(batch[0], batch[1], atol=1e-3)  # different texts, different vectors


def test_token_ids_and_texts_embed_alike_and_base64_equals_floats(client: openai.OpenAI, models: dict[str, Path]
                                                                  ) -> None:
    ids = [token_ids(models[BERT], t) for t in TEXTS[:2]]
    floats = vectors(client, BERT, TEXTS[:2], encoding_format="float")
    np.testing.assert_allclose(vectors(client, BERT, ids, encoding_format="float"), floats, atol=1e-6)
    np.testing.assert_allclose(vectors(client, BERT, ids[0])[0], floats[0], atol=1e-6)  # one list of ids
    np.testing.assert_array_equal(vectors(client, BERT, TEXTS[:2]), floats)  # the SDK's default: base64


def test_dimensions_keep_the_first_numbers_at_unit_length(client: openai.OpenAI) -> None:
    whole = vectors(client, BERT, TEXTS[0])[0]
    cut = vectors(client, BERT, TEXTS[0], dimensions=16)[0]
    assert cut.shape == (16,)
    np.testing.assert_allclose(cut, whole[:16] / np.linalg.norm(whole[:16]), atol=1e-6)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=BERT, input="a", dimensions=65)
    assert "makes vectors of 64" in err.value.message and err.value.body["param"] == "dimensions"  # type: ignore[index]


def test_a_text_past_the_window_is_a_400_or_cut_when_asked(sup: SupervisorProcess, client: openai.OpenAI) -> None:
    long = " ".join(["fox"] * 80)  # BERT's window here is 64 tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=BERT, input=["a", long])
    assert "input[1] is" in err.value.message and err.value.code == "context_length_exceeded"
    cut = sup.client.post("/v1/embeddings", json={"model": BERT, "input": long, "truncate": True})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 64


@pytest.mark.parametrize(("body", "says"), [
    ({"model": BERT, "input": []}, "must not be empty"),
    ({"model": BERT, "input": ["a", ""]}, "input[1] is empty"),
    ({"model": BERT, "input": ["a", 1]}, "not a mix"),
    ({"model": BERT, "input": [1, 99999]}, "outside the vocabulary"),
    ({"model": BERT, "input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"model": BERT, "input": 5}, "input"),
    ({"model": BERT}, "input"),
    ({"model": CHAT, "input": "a"}, f"Model {CHAT} is not an embedding model"),
])
def test_bad_requests_are_a_400_that_says_why(sup: SupervisorProcess, body: dict[str, Any], says: str) -> None:
    got = sup.client.post("/v1/embeddings", json=body)
    assert got.status_code == 400, got.text
    assert says in got.json()["error"]["message"]


def test_malformed_json_unknown_models_and_chat_on_an_embedding_model(sup: SupervisorProcess,
                                                                      client: openai.OpenAI) -> None:
    bad = sup.client.post("/v1/embeddings", content=b'{"model": "bert", "input": ', headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=BERT, messages=[{"role": "user", "content": "hi"}])
    assert "is an embedding model" in err.value.message


def test_concurrent_requests_share_forwards_and_each_gets_its_own(sup: SupervisorProcess, client: openai.OpenAI
                                                                  ) -> None:
    alone = {t: vectors(client, QWEN, t)[0] for t in TEXTS}
    before = sup.engine_stats(QWEN)["requests"]
    asks = [TEXTS[i % 3] for i in range(24)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: vectors(client, QWEN, t)[0], asks))
    for text, vector in zip(asks, got, strict=True):
        np.testing.assert_allclose(vector, alone[text], atol=1e-5)
    after = sup.engine_stats(QWEN)["requests"]
    assert after["completed"] - before["completed"] == 24 and after["failed"] == before["failed"]


def test_a_caller_that_leaves_costs_nothing_after(sup: SupervisorProcess, client: openai.OpenAI) -> None:
    many = [" ".join(["fox jumps"] * 20)] * 2048
    with pytest.raises(httpx.TimeoutException):
        sup.client.post("/v1/embeddings", json={"model": BERT, "input": many}, timeout=0.05)
    np.testing.assert_allclose(vectors(client, BERT, TEXTS[0])[0], vectors(client, BERT, [TEXTS[0]])[0], atol=1e-6)
    assert sup.engine_stats(BERT)["status"] == "ready"


def test_the_model_list_says_embedding(sup: SupervisorProcess) -> None:
    found = {m["id"]: m["capabilities"] for m in sup.client.get("/v1/models").json()["data"]}
    assert found[BERT] == ["embedding"] and found[QWEN] == ["embedding"] and "completion" in found[CHAT]


def test_ollamas_embed_routes_with_its_client(sup: SupervisorProcess, client: openai.OpenAI) -> None:
    oc = ollama.Client(host=sup.url, timeout=60)
    try:
        answer = oc.embed(model=BERT, input=TEXTS)
        np.testing.assert_allclose(np.array(answer.embeddings), vectors(client, BERT, TEXTS), atol=1e-6)
        assert answer.model == BERT and answer.prompt_eval_count > 0 and answer.total_duration > 0
        one = oc.embeddings(model=BERT + ":latest", prompt=TEXTS[0])  # the older route, one text
        np.testing.assert_allclose(np.array(one.embedding), vectors(client, BERT, TEXTS[0])[0], atol=1e-6)
        cut = oc.embed(model=BERT, input=" ".join(["fox"] * 80))  # Ollama's truncate is on by default
        assert len(cut.embeddings) == 1 and cut.prompt_eval_count == 64
        assert oc.embed(model=BERT, input=TEXTS[0], dimensions=8).embeddings[0].__len__() == 8
        assert oc.embed(model=BERT, input=[]).embeddings == []  # nothing to embed: it loads the model
        with pytest.raises(ollama.ResponseError) as err:
            oc.embed(model=CHAT, input="a")
        assert err.value.status_code == 400 and "not an embedding model" in err.value.error
        with pytest.raises(ollama.ResponseError) as err:
            oc.embed(model=BERT, input=" ".join(["fox"] * 80), truncate=False)
        assert err.value.status_code == 400 and "embeds at most 64" in err.value.error
    finally:
        oc._client.close()
