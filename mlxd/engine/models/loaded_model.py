"""A model and tokenizer loaded with mlx-lm, plus what the engine needs to know about them."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from mlxd.engine.chat.grammar import Grammars
from mlxd.engine.chat.reasoning import ThinkMarkers, think_markers
from mlxd.engine.chat.tools import ToolFormat, format_of, template_takes_tools
from mlxd.engine.models import audio, vision
from mlxd.engine.models.adapter_bank import AdapterBank
from mlxd.engine.models.image_memo import ImageMemo, PromptMedia
from mlxd.engine.models.load_meter import LoadMeter
from mlxd.protocol import sampling
from mlxd.protocol.errors import APIError
from mlxd.protocol.memory import context_window, text_config

MIN_CHUNK_BYTES = 256 << 20  # weights are read at least this much per step of the load's progress
MAX_CHUNKS = 32  # ... and in at most about this many steps (each step's sync costs: benchmarks/load_progress.py)


class ModelLoadError(Exception):
    """The model dir cannot be served (missing, malformed, unsupported)."""


class LoadedModel:
    """The weights and tokenizer of one model; runs only on the GPU thread (load) or pure CPU."""

    def __init__(
        self, path: Path, model_id: str, max_context: int | None = None, meter: LoadMeter | None = None,
        split: Callable[[nn.Module, dict[str, Any]], None] | None = None,
    ) -> None:
        """`split`: applied to the model before its weights are read (an engine group's rank keeps
        only its part: group/ranks.py's `splitter`)."""
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not an MLX model dir (no config.json)")
        self.vlm: nn.Module | None = None  # a vision-language model's whole mlx-vlm model (models/vision.py)
        self.processor: Any = None  # ... and its processor
        try:
            if vision.is_vlm_dir(path):
                if split is not None:
                    raise ModelLoadError("models that take images cannot be split over an engine group yet")
                self.vlm, self.processor, self.model, self.tokenizer = load_vlm_with_progress(path, meter or LoadMeter())
            else:
                self.model, self.tokenizer = load_with_progress(path, meter or LoadMeter(), split)
        except ModelLoadError:
            raise
        except vision.VisionExtraMissing as exc:
            raise ModelLoadError(f"cannot load {path}: {exc}") from exc
        except Exception as exc:  # mlx-lm raises many kinds; all mean "cannot load"
            raise ModelLoadError(f"cannot load {path}: {type(exc).__name__}: {exc}") from exc
        self.path = path
        self.model_id = model_id
        self.config = text_config(json.loads((path / "config.json").read_text()))
        self.context_window = context_window(self.config, max_context)
        self.native_context = context_window(self.config, None)  # the model's own, uncapped
        self.vocab_size = int(self.config.get("vocab_size") or len(self.tokenizer))
        self.generation_defaults = generation_defaults(path)
        self.configured = sampling.Defaults()  # mlxd's config's defaults for its requests (the engine's --defaults)
        self.drafts: Any = None  # what it drafts with, once opened (spec/drafters.py's DraftSource)
        self.split: str | None = None  # the part an engine group's rank holds (`tensor 1/2`): its SSD tier's

    @property
    def takes_images(self) -> bool:
        return self.vlm is not None and self.image_token_id is not None

    @property
    def takes_audio(self) -> bool:
        return self.audio_token_id is not None

    @functools.cached_property
    def audio_token_id(self) -> int | None:
        """The token an audio clip's embeddings take the place of (None: no audio tower)."""
        return audio.audio_token_id(self.config, self.processor) if self.vlm is not None else None

    @property
    def media_tokens(self) -> dict[str, int]:
        """The token each kind of media part's embeddings take the place of."""
        found = {"image": self.image_token_id, "audio": self.audio_token_id}
        return {kind: token for kind, token in found.items() if token is not None}

    @property
    def audio_rate(self) -> int:
        return audio.sampling_rate(self.processor) if self.takes_audio else 16000

    @property
    def audio_seconds(self) -> float:
        return audio.max_seconds(self.processor) if self.takes_audio else audio.DEFAULT_MAX_SECONDS

    @functools.cached_property
    def image_token_id(self) -> int | None:
        """The token an image's embeddings take the place of (None: the model takes no images)."""
        if self.vlm is None:
            return None
        for key in ("image_token_id", "image_token_index"):
            if (value := self.config.get(key)) is not None:
                return int(value)
        return getattr(self.processor, "image_token_id", None)

    def media_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
        images: PromptMedia,
    ) -> tuple[list[int], vision.MediaPrompt]:
        """Token ids of the chat template applied to `messages` whose image parts are `images`
        (each image's tokens expanded by the model's processor, from the decoded pictures or what
        the image memo kept of them), and what the GPU thread needs for them. Blocking: run it on
        the templating thread."""
        if not self.takes_images:
            raise APIError(400, f"Model {self.model_id} does not take images.", param="messages",
                           code="unsupported_content")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **dict(template_kwargs or {})
            )
        except Exception as exc:
            raise APIError(400, f"Chat template failed: {exc}", param="messages") from exc
        return vision.prepare(self.processor, str(text), images, self.media_tokens,
                              lambda call: self.image_memo.run(self.processor, call, images))

    @functools.cached_property
    def adapters(self) -> AdapterBank:
        """The LoRA adapters mounted on the model, served per row (models/adapter_bank.py)."""
        refusal = "adapters are served on text models only" if self.vlm is not None else None
        return AdapterBank(self.model, refusal)

    @functools.cached_property
    def image_memo(self) -> ImageMemo:
        """What the processor made of recently seen images (models/image_memo.py)."""
        return ImageMemo()

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    @functools.cached_property
    def xtc_exempt(self) -> tuple[int, ...]:
        """Tokens XTC never excludes: the end of the reply and a newline (the reference's rule,
        and mlx-lm's server's), so that it cannot keep an answer from ending or a line from
        breaking."""
        return tuple(sorted({*self.eos_token_ids, *self.encode_text("\n")}))

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        """Token ids of the chat template applied to `messages`, ready for the assistant turn."""
        if not self.tokenizer.has_chat_template:
            raise APIError(
                400, f"Model {self.model_id} has no chat template; use /v1/completions.",
                param="messages",
            )
        kwargs = dict(template_kwargs or {})
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs
            )
        except Exception as exc:  # a template raising (e.g. roles must alternate) is bad input
            raise APIError(400, f"Chat template failed: {exc}", param="messages") from exc
        return list(ids)

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """How this model calls tools (mlxd.engine.chat.tools), found once."""
        return format_of(self.tokenizer, template_takes_tools(self.tokenizer))

    @functools.cached_property
    def think_markers(self) -> ThinkMarkers | None:
        """The markers of the model's reasoning block (mlxd.engine.chat.reasoning), if any."""
        return think_markers(self.tokenizer)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Compiled grammars for structured output (mlxd.engine.chat.grammar)."""
        return Grammars(self.tokenizer._tokenizer, sorted(self.eos_token_ids))

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` to append to a prompt (no BOS)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids for a raw completion prompt (BOS added as the tokenizer says)."""
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"Token id {bad[0]} is outside the vocabulary.", param="prompt")
            return list(prompt)
        return list(self.tokenizer.encode(prompt))

    def decode(self, ids: list[int]) -> str:
        """Text for token ids (used for `echo`)."""
        return str(self.tokenizer.decode(ids))


def load_with_progress(path: Path, meter: LoadMeter, split: Callable[[nn.Module, dict[str, Any]], None] | None = None,
                       ) -> tuple[nn.Module, TokenizerWrapper]:
    """mlx-lm's load, its weights read a chunk at a time so that `meter` can say how far it got
    (only those `split` leaves the model, when given)."""
    model, config = load_model(path, lazy=True)
    if split is not None:
        split(model, text_config(config))
    read_weights(model, meter)
    meter.begin("tokenizer")
    return model, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def load_vlm_with_progress(path: Path, meter: LoadMeter) -> tuple[nn.Module, Any, nn.Module, TokenizerWrapper]:
    """mlx-vlm's model and processor (models/vision.py), its weights read a chunk at a time as in
    `load_with_progress`, the language model as the lanes run it, and mlx-lm's tokenizer of the
    same files (chat templates, tool calls and streaming detokenizing as for any model)."""
    vlm, processor = vision.load_vlm(path)
    read_weights(vlm, meter)
    meter.begin("tokenizer")
    eos = getattr(vlm.config, "eos_token_id", None)
    return vlm, processor, vision.TextView(vlm), load_tokenizer(path, eos_token_ids=eos)


def read_weights(model: nn.Module, meter: LoadMeter) -> None:
    arrays: list[mx.array] = [array for _, array in tree_flatten(model.parameters())]  # type: ignore[misc, str-unpack]
    total = sum(a.nbytes for a in arrays)
    meter.begin("weights", total, "bytes")
    for chunk in _chunks(arrays, max(MIN_CHUNK_BYTES, total // MAX_CHUNKS)):
        mx.eval(chunk)
        meter.advance(sum(a.nbytes for a in chunk))


def _chunks(arrays: list[mx.array], max_bytes: int) -> list[list[mx.array]]:
    """`arrays` in runs of about `max_bytes` (a larger array is a run of its own)."""
    runs: list[list[mx.array]] = [[]]
    size = 0
    for array in arrays:
        if runs[-1] and size + array.nbytes > max_bytes:
            runs.append([])
            size = 0
        runs[-1].append(array)
        size += array.nbytes
    return [run for run in runs if run]


def wire_model_memory() -> None:
    """On Metal, keep model memory wired for the engine's whole life (mlx-lm does it per call)."""
    if mx.metal.is_available():
        mx.set_wired_limit(int(mx.device_info()["max_recommended_working_set_size"]))


def generation_defaults(path: Path) -> dict[str, float]:
    """Sampling defaults the model ships in generation_config.json (protocol.sampling says which)."""
    return sampling.model_defaults(read_json(path / "generation_config.json"))


def read_json(file: Path) -> Any:
    """A JSON file's value; None when it is missing or not JSON."""
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None
