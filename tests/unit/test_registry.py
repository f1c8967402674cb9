"""Model discovery (config, models dir, hub cache) and resolving a request's `model`."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.protocol.errors import APIError
from mlxd.protocol.sampling import Defaults
from mlxd.supervisor.config import ModelConfig
from mlxd.supervisor.registry import (
    ModelEntry,
    Registry,
    hf_cache_dir,
    is_mlx_model_dir,
    sampling_of,
)


def make_model(path: Path, weights: int = 10) -> Path:
    """A placeholder MLX model dir: config.json, one safetensors file, a tokenizer."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"w" * weights)
    (path / "tokenizer.json").write_text("{}")
    return path


def make_hf_repo(cache: Path, repo_id: str, revision: str = "abc123", weights: int = 100) -> Path:
    """A hub-cache repo laid out like huggingface_hub: blobs, a snapshot of symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name, data in [("config.json", b"{}"), ("model.safetensors", b"w" * weights)]:
        blob = blobs / f"{revision}-{name}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    models, cache = tmp_path / "models", tmp_path / "hub"
    models.mkdir()
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return models, cache


def registry(models_dir: Path, config: dict[str, ModelConfig] | None = None) -> Registry:
    return Registry(config, models_dir=models_dir)


def ids(reg: Registry) -> list[str]:
    return [e.id for e in reg.entries()]


def api_error(reg: Registry, model: str | None, loaded: list[str] | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        reg.resolve(model, loaded or [])
    return info.value


def test_hf_cache_dir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_cache_dir({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert hf_cache_dir({"HF_HOME": "/b"}) == Path("/b/hub")
    assert hf_cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/hub")
    assert hf_cache_dir({}) == tmp_path / ".cache" / "huggingface" / "hub"


def test_models_dir(dirs: tuple[Path, Path]) -> None:
    models, _ = dirs
    make_model(models / "SmolLM2-135M-Instruct", weights=10)
    make_model(models / "other", weights=5)
    (models / "no-weights").mkdir()
    (models / "no-weights" / "config.json").write_text("{}")
    make_model(models / ".SmolLM2.importing-x")
    (models / "stray-file.txt").write_text("x")
    reg = registry(models)
    assert ids(reg) == ["other", "SmolLM2-135M-Instruct"]
    entry = reg.resolve("SmolLM2-135M-Instruct", [])
    assert entry.source == "models_dir" and entry.path == models / "SmolLM2-135M-Instruct"
    assert entry.size_bytes == 2 + 10 + 2


def test_hf_cache(dirs: tuple[Path, Path]) -> None:
    models, cache = dirs
    snapshot = make_hf_repo(cache, "mlx-community/Qwen3-4B-4bit", weights=100)
    make_hf_repo(cache, "gpt2")
    (cache / "datasets--x--y").mkdir()
    (cache / "models--org--not-mlx" / "snapshots" / "r1").mkdir(parents=True)
    (cache / "models--org--not-mlx" / "snapshots" / "r1" / "config.json").write_text("{}")
    reg = registry(models)
    assert ids(reg) == ["gpt2", "mlx-community/Qwen3-4B-4bit"]
    entry = reg.resolve("mlx-community/Qwen3-4B-4bit", [])
    assert entry.source == "hf_cache" and entry.path == snapshot
    assert entry.size_bytes == 2 + 100  # symlinks followed to the blobs


def test_hf_cache_follows_refs_main(dirs: tuple[Path, Path]) -> None:
    models, cache = dirs
    make_hf_repo(cache, "org/m", revision="old")
    new = make_hf_repo(cache, "org/m", revision="new")
    assert registry(models).resolve("org/m", []).path == new
    (cache / "models--org--m" / "refs" / "main").write_text("old")
    assert registry(models).resolve("org/m", []).path.name == "old"


def test_hf_cache_without_usable_ref_takes_a_valid_snapshot(dirs: tuple[Path, Path]) -> None:
    models, cache = dirs
    make_hf_repo(cache, "org/m", revision="good")
    (cache / "models--org--m" / "refs" / "main").write_text("missing")
    (cache / "models--org--m" / "snapshots" / "partial").mkdir()
    assert registry(models).resolve("org/m", []).path.name == "good"


def test_broken_symlink_is_not_a_model(dirs: tuple[Path, Path]) -> None:
    models, cache = dirs
    snapshot = make_hf_repo(cache, "org/m")
    (cache / "models--org--m" / "blobs" / "abc123-model.safetensors").unlink()
    assert not is_mlx_model_dir(snapshot)
    assert ids(registry(models)) == []


def test_refresh_sees_new_and_removed_models(dirs: tuple[Path, Path]) -> None:
    models, _ = dirs
    reg = registry(models)
    assert ids(reg) == []
    make_model(models / "a")
    reg.refresh()
    assert ids(reg) == ["a"]
    for child in (models / "a").iterdir():
        child.unlink()
    reg.refresh()
    assert ids(reg) == []


def test_config_entries_win(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, cache = dirs
    make_model(models / "m")
    make_hf_repo(cache, "org/x")
    custom = make_model(tmp_path / "custom")
    config = {
        "m": ModelConfig(path=str(custom), pin=True, max_context=2048),
        "org/x": ModelConfig(path=str(custom)),
    }
    reg = registry(models, config)
    entry = reg.resolve("m", [])
    assert (entry.source, entry.path, entry.pin, entry.max_context) == (
        "config",
        custom,
        True,
        2048,
    )
    assert reg.resolve("org/x", []).source == "config"
    assert ids(reg) == ["m", "org/x"]


def test_batch_width_is_the_entry_s_else_the_pool_s(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, cache = dirs
    make_model(models / "scanned")
    make_hf_repo(cache, "org/hub")
    config = {
        "own": ModelConfig(path=str(make_model(tmp_path / "own")), batch=2),
        "plain": ModelConfig(path=str(make_model(tmp_path / "plain"))),
        "missing": ModelConfig(path=str(tmp_path / "nowhere"), batch=1),
    }
    widths = {e.id: e.batch for e in Registry(config, models_dir=models, batch=3).entries()}
    assert widths == {"missing": 1, "org/hub": 3, "own": 2, "plain": 3, "scanned": 3}
    # Without a pool width: [pool] batch's default.
    widths = {e.id: e.batch for e in Registry(config, models_dir=models).entries()}
    assert widths == {"missing": 1, "org/hub": "auto", "own": 2, "plain": "auto", "scanned": "auto"}
    reg = Registry(config, models_dir=models, batch=5)
    reg.refresh()  # a rescan keeps the pool's width
    assert reg.resolve("scanned", []).batch == 5


def test_a_draft_model_is_named_as_requests_name_it_and_given_to_the_engine_as_its_dir(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    models, _ = dirs
    small = make_model(models / "small", weights=7)
    elsewhere = make_model(tmp_path / "elsewhere", weights=5)
    config = {
        "big": ModelConfig(path=str(make_model(tmp_path / "big")), draft="small"),
        "by-path": ModelConfig(path=str(make_model(tmp_path / "by-path")), draft=str(elsewhere)),
        "lookup": ModelConfig(path=str(make_model(tmp_path / "lookup")), draft="ngram"),
        "gone": ModelConfig(path=str(make_model(tmp_path / "gone")), draft="no-such-model"),
    }
    reg = Registry(config, models_dir=models, draft="self:2")
    got = {e.id: (e.draft, e.draft_bytes) for e in reg.entries()}
    assert got["big"] == (str(small), 7 + 4)  # its weights, config.json and tokenizer.json
    assert got["by-path"] == (str(elsewhere), 5 + 4)
    assert got["lookup"] == ("ngram", 0)
    assert got["gone"] == ("no-such-model", 0)  # the engine's load error says it is not a model
    assert got["small"] == (None, 0)  # the pool's self:2 reaches it through the engines' flags
    # A draft model named in [pool] drafts for every model but itself.
    reg = Registry({}, models_dir=models, draft="small")
    make_model(models / "other")
    reg.refresh()
    got = {e.id: (e.draft, e.draft_bytes) for e in reg.entries()}
    assert got == {"other": (str(small), 11), "small": ("none", 0)}


def test_request_defaults_are_the_models_own_over_the_servers(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, _ = dirs
    make_model(models / "scanned")
    config = {
        "cold": ModelConfig(path=str(make_model(tmp_path / "cold")), defaults=Defaults(temperature=0.2, thinking=False)),
        "plain": ModelConfig(path=str(make_model(tmp_path / "plain"))),
    }
    reg = Registry(config, models_dir=models, defaults=Defaults(temperature=0.7, max_tokens=512))
    got = {e.id: e.defaults for e in reg.entries()}
    assert got["cold"] == Defaults(temperature=0.2, max_tokens=512, thinking=False)
    assert got["plain"] == got["scanned"] == Defaults(temperature=0.7, max_tokens=512)
    assert sampling_of(reg.resolve("cold", []))["temperature"] == 0.2  # what /v1/models shows
    alone = {e.id: e.defaults for e in Registry(config, models_dir=models).entries()}
    assert alone == {"cold": Defaults(temperature=0.2, thinking=False), "plain": None, "scanned": None}  # no [defaults]


def test_config_entry_with_bad_path_is_listed_but_unavailable(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    models, _ = dirs
    reg = registry(models, {"ghost": ModelConfig(path=str(tmp_path / "nowhere"))})
    [entry] = reg.entries()
    assert (entry.id, entry.is_available, entry.size_bytes) == ("ghost", False, 0)
    err = api_error(reg, "ghost")
    assert err.status == 400 and err.code == "model_unavailable" and err.param == "model"
    assert str(tmp_path / "nowhere") in err.message and "not an MLX model dir" in err.message


def test_config_path_with_tilde(
    dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models, _ = dirs
    monkeypatch.setenv("HOME", str(tmp_path))
    make_model(tmp_path / "mine")
    assert (
        registry(models, {"mine": ModelConfig(path="~/mine")}).resolve("mine", []).path
        == tmp_path / "mine"
    )


def test_case_insensitive_and_short_name(dirs: tuple[Path, Path]) -> None:
    models, cache = dirs
    make_hf_repo(cache, "mlx-community/Qwen3-4B-4bit")
    make_hf_repo(cache, "a/dup")
    make_hf_repo(cache, "b/dup")
    make_model(models / "Exact")
    make_model(models / "exact")
    reg = registry(models)
    assert reg.resolve("MLX-COMMUNITY/qwen3-4b-4bit", []).id == "mlx-community/Qwen3-4B-4bit"
    assert reg.resolve("Qwen3-4B-4bit", []).id == "mlx-community/Qwen3-4B-4bit"
    assert reg.resolve("exact", []).id == "exact"
    assert reg.resolve("Exact", []).id == "Exact"
    assert api_error(reg, "dup").status == 404  # ambiguous short name


def test_unknown_model_is_404_listing_ids(dirs: tuple[Path, Path]) -> None:
    models, _ = dirs
    for name in ["m1", "m2", "m3", "m4", "m5", "m6", "m7"]:
        make_model(models / name)
    err = api_error(registry(models), "x")
    assert err.status == 404
    assert (err.type, err.param, err.code) == ("invalid_request_error", "model", "model_not_found")
    assert err.message == "Model 'x' not found. Available: m1, m2, m3, m4, m5 (and 2 more)"


def test_unknown_model_lists_close_matches_first(dirs: tuple[Path, Path]) -> None:
    models, _ = dirs
    for name in ["alpha", "beta", "gamma", "delta", "epsilon", "llama-3b"]:
        make_model(models / name)
    err = api_error(registry(models), "llama-3")
    assert err.message.startswith("Model 'llama-3' not found. Available: llama-3b, ")


def test_unknown_model_with_nothing_available(dirs: tuple[Path, Path]) -> None:
    models, _ = dirs
    err = api_error(registry(models), "x")
    assert err.status == 404 and "No models are available" in err.message


def test_few_models_listed_without_more(dirs: tuple[Path, Path]) -> None:
    models, _ = dirs
    make_model(models / "a")
    make_model(models / "b")
    assert api_error(registry(models), "zzz").message == "Model 'zzz' not found. Available: a, b"


def test_missing_model_uses_the_only_configured_one(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    models, cache = dirs
    make_model(models / "a")
    make_hf_repo(cache, "org/b")
    reg = registry(models, {"mine": ModelConfig(path=str(make_model(tmp_path / "mine")))})
    assert reg.resolve(None, []).id == "mine"
    assert reg.resolve("", ["a", "org/b"]).id == "mine"


def test_missing_model_uses_the_only_loaded_one(dirs: tuple[Path, Path]) -> None:
    models, _ = dirs
    make_model(models / "a")
    make_model(models / "b")
    reg = registry(models)
    assert reg.resolve(None, ["b"]).id == "b"
    assert reg.resolve(None, ["b", "b", "gone"]).id == "b"
    err = api_error(reg, None, ["a", "b"])
    assert (err.status, err.param, err.code) == (400, "model", "model_required")
    assert "Available: a, b" in err.message
    assert api_error(reg, None).code == "model_required"


def test_missing_model_with_a_single_model_known(dirs: tuple[Path, Path]) -> None:
    models, _ = dirs
    make_model(models / "only")
    assert registry(models).resolve(None, []).id == "only"


def test_missing_model_with_two_configured(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, _ = dirs
    config = {n: ModelConfig(path=str(make_model(tmp_path / n))) for n in ["x", "y"]}
    reg = registry(models, config)
    assert api_error(reg, None).code == "model_required"
    assert reg.resolve(None, ["y"]).id == "y"


def test_default_models_dir_comes_from_the_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    make_model(tmp_path / "data" / "models" / "dm")
    make_hf_repo(tmp_path / "hub", "o/h")
    assert ids(Registry()) == ["dm", "o/h"]


def test_a_model_pulled_since_the_last_scan_is_found_by_its_first_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlxd.supervisor.registry as registry_module

    now = [100.0]
    monkeypatch.setattr(registry_module.time, "monotonic", lambda: now[0])
    cache, models = tmp_path / "hub", tmp_path / "models"
    registry = Registry({}, models_dir=models, hf_cache=cache)
    registry.refresh()
    make_hf_repo(cache, "org/fresh")  # `mlxd pull` while the daemon runs
    assert registry.resolve("org/fresh").id == "org/fresh"
    make_model(models / "later")
    now[0] += 0.5
    with pytest.raises(APIError) as missing:  # a second miss within the second does not rescan
        registry.resolve("later")
    assert missing.value.status == 404
    now[0] += 0.5
    assert registry.resolve("later").id == "later"


def test_a_models_sampling_is_its_generation_configs_over_mlxds(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    entry = ModelEntry(id="m", path=model, source="models_dir", size_bytes=0)
    assert sampling_of(entry) == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    (model / "generation_config.json").write_text('{"temperature": 0.2, "top_p": 0.9, "top_k": 1e30, "eos_token_id": 2}')
    assert sampling_of(entry) == {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05}  # 1e30: out of range
    (model / "generation_config.json").write_text("{")
    assert sampling_of(entry) == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
