"""The pure parts of `mlxd pull`: repo specs, which files, which model types, the pull record, what a
range answer means, and the check of a finished partial download."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from huggingface_hub import constants
from huggingface_hub.utils import tqdm

from mlxd.hub.partial_download import PartialDownload, PullError, answer_start, download_headers
from mlxd.hub.pull_record import PullRecord
from mlxd.hub.puller import (
    MlxLmModels,
    RemoteFile,
    find_mlx_lm,
    is_resumable,
    mlx_model_type,
    parse_spec,
    select_files,
)

MODELS = MlxLmModels(
    frozenset({"llama", "qwen3", "bailing_moe_v3", "bailing_hybrid"}),
    {"mistral": "llama"},
    {("bailing_hybrid", "BailingMoeV3ForCausalLM"): "bailing_moe_v3"},
)


def test_a_spec_is_a_repo_and_a_revision_main_by_default() -> None:
    assert parse_spec("mlx-community/Qwen3-0.6B-4bit") == ("mlx-community/Qwen3-0.6B-4bit", "main")
    assert parse_spec(" org/name@v1.0 ") == ("org/name", "v1.0")
    assert parse_spec("gpt2@" + "a" * 40) == ("gpt2", "a" * 40)


@pytest.mark.parametrize("spec", ["org/name@", "not a repo", "a/b/c", "", "org/name..x"])
def test_a_bad_spec_is_refused(spec: str) -> None:
    with pytest.raises(PullError):
        parse_spec(spec)


def test_only_the_files_mlx_lm_reads_are_selected() -> None:
    names = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer.model", "merges.txt", "vocab.json", "chat_template.jinja", "generation_config.json",
             "qwen.tiktoken", "pytorch_model.bin", "model.gguf", "consolidated.safetensors", "onnx/model.onnx",
             "onnx/config.json", "original/params.json", "README.md", ".gitattributes", "modeling_x.py",
             "model.pth"]
    assert [f.name for f in select_files((n, 1) for n in names)] == [
        "config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer.model", "merges.txt", "vocab.json", "chat_template.jinja", "generation_config.json",
        "qwen.tiktoken",
    ]


def test_model_types_resolve_as_mlx_lm_resolves_them() -> None:
    assert mlx_model_type({"model_type": "llama"}, MODELS) == "llama"
    assert mlx_model_type({"model_type": "mistral"}, MODELS) == "llama"
    arch = {"model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"]}
    assert mlx_model_type(arch, MODELS) == "bailing_moe_v3"
    assert mlx_model_type({"model_type": "bailing_hybrid", "architectures": "Other"}, MODELS) == "bailing_hybrid"


@pytest.mark.parametrize(("config", "reason"), [
    ({"model_type": "bert"}, "model_type 'bert' is not supported by the installed mlx-lm"),
    ({}, "its config.json has no model_type, so mlx-lm cannot load it"),
    ({"model_type": 3}, "its config.json has no model_type, so mlx-lm cannot load it"),
])
def test_other_model_types_are_refused(config: dict[str, object], reason: str) -> None:
    with pytest.raises(PullError, match=f"^{reason}$"):
        mlx_model_type(config, MODELS)


def test_the_installed_mlx_lm_is_read_without_importing_it() -> None:
    models = find_mlx_lm()
    assert models is not None
    assert {"llama", "qwen2", "mistral3"} <= models.types
    assert models.remapping["mistral"] == "llama"
    assert mlx_model_type({"model_type": "mistral"}, models) == "llama"


def test_the_record_keeps_pulls_per_cache(tmp_path: Path) -> None:
    record = PullRecord(tmp_path / "data")
    cache_a, cache_b = tmp_path / "a", tmp_path / "b"
    assert record.find("org/x", cache_a) is None
    record.add("org/x", cache_a, "main", "c" * 40)
    record.add("org/x", cache_a, "v2", "d" * 40)  # a second pull replaces the first record
    record.add("org/y", cache_b, "main", "e" * 40)
    pull = record.find("org/x", tmp_path / "b" / ".." / "a")
    assert pull is not None and (pull.revision, pull.commit) == ("v2", "d" * 40)
    assert record.find("org/x", cache_b) is None
    record.remove("org/x", cache_a)
    assert [p.repo for p in record.pulls()] == ["org/y"]


def test_a_damaged_record_owns_nothing(tmp_path: Path) -> None:
    record = PullRecord(tmp_path)
    record.path.write_text("{not json")
    assert record.pulls() == []
    record.path.write_text('{"version": 1, "pulls": [{"repo": 3}]}')
    assert record.find("3", tmp_path) is None


def test_weights_and_big_files_are_resumable() -> None:
    assert is_resumable(RemoteFile("model-00001-of-00002.safetensors", 100))
    assert is_resumable(RemoteFile("tokenizer.json", 8 * 1024 * 1024))
    assert not is_resumable(RemoteFile("tokenizer.json", 8 * 1024 * 1024 - 1))
    assert not is_resumable(RemoteFile("config.json", None))


@pytest.mark.parametrize(("status", "content_range", "start"), [
    (200, None, 0),
    (206, "bytes 100-999/1000", 100),
    (206, "bytes 100-999/*", 100),
    (206, None, None),
    (206, "bytes */1000", None),
    (416, "bytes */1000", None),
    (500, None, None),
])
def test_an_answer_starts_where_its_status_and_content_range_say(status: int, content_range: str | None,
                                                                 start: int | None) -> None:
    assert answer_start(status, content_range) == start


def test_the_token_goes_to_the_hub_but_not_to_a_cdn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    url = f"{constants.ENDPOINT}/org/model/resolve/{'a' * 40}/model.safetensors"
    assert download_headers(url, url)["authorization"] == "Bearer hf_secret"
    cdn = download_headers(url, "https://cas-bridge.xethub.hf.co/xet-bridge-us/abc?X-Amz-Signature=x")
    assert "authorization" not in cdn
    assert cdn["Accept-Encoding"] == "identity"


def test_a_partial_file_that_is_not_the_hubs_is_deleted(tmp_path: Path) -> None:
    data = b"weights" * 1000
    blob = tmp_path / hashlib.sha256(data).hexdigest()
    download = PartialDownload("model.safetensors", blob, "http://unused", {}, len(data))
    download.partial.write_bytes(data[:-1] + b"!")
    with pytest.raises(PullError, match=r"^model.safetensors came down corrupt \(its sha256 is not "):
        download.run(tqdm, lambda exc: None)  # nothing to fetch: it has every byte
    assert not download.partial.exists() and not blob.exists()
    download.partial.write_bytes(data)
    download.run(tqdm, lambda exc: None)
    assert blob.read_bytes() == data and not download.partial.exists()
