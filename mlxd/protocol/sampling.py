"""The sampling a request gets when it sets none: the model's own defaults, else mlxd's.

Read by the engine (which samples with them) and the supervisor (which shows them in
`/v1/models` and `/admin/engines`). Pure: the caller reads `generation_config.json`.

mlxd's defaults are llama.cpp's, which Ollama and LM Studio ship in much the same form: a
temperature of 0.8, then top-k 40, top-p 0.95 and min-p 0.05. Sampling at 1.0 over the whole
vocabulary (OpenAI's defaults, which mlxd used before) lets a small model's long tail of
unlikely tokens in: SmolLM2-135M named the capital of France "Le Grand Citel" two times in
three. The truncation keeps only tokens the model finds plausible (min-p: at least 5% of the
likeliest's probability), and the lower temperature sharpens what is left, while answers still
vary from run to run. Each value is taken on its own: a request that sets a temperature still
gets the truncation unless it sets that too, as in Ollama. A model whose file says
`"do_sample": false` is greedy (temperature 0), as transformers reads it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from mlxd.protocol.curve import Hlg

MLXD_DEFAULTS: dict[str, float] = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}

# What a generation_config.json value may be, by key (NaN fails every test).
MODEL_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "top_k": (0, 2**31 - 1), "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 10.0),
}


def model_defaults(config: Any) -> dict[str, float]:
    """The sampling values a model's generation_config.json sets (its decoded JSON; anything
    else is no values). Out-of-range ones (Infinity, NaN, a top_k of 1e30) are dropped: a
    request's own are range-checked, and a model's file must not make every request fail."""
    if not isinstance(config, dict):
        return {}
    out: dict[str, float] = {}
    for key, (low, high) in MODEL_RANGES.items():
        value = config.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high:
            out[key] = float(value)
    if config.get("do_sample") is False:
        # transformers' meaning: greedy, whatever temperature and truncation the file also lists
        # (they apply only when sampling); a repetition penalty still applies.
        out = {key: value for key, value in out.items() if key == "repetition_penalty"}
        out["temperature"] = 0.0
    return out


Unit = Annotated[float, Meta(ge=0.0, le=1.0)]


class Defaults(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """What a request that sets none gets, by mlxd's config: `[defaults]` for every model,
    `[models.NAME.defaults]` for one. Over the model's generation_config.json and mlxd's own;
    a request's own values win over all of them."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    min_p: Unit | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None  # a reply's length (None: the context's room)
    thinking: bool | None = None  # the chat template's enable_thinking (None: as the model's vocabulary says)
    hlg: Hlg | None = None  # the HLG tone curve, for requests that do not turn it off (protocol/curve.py)

    def over(self, base: Defaults | None) -> Defaults:
        """These values, and `base`'s where these leave one unset."""
        if base is None:
            return self
        merged = Defaults(**{**msgspec.structs.asdict(base), **{k: v for k, v in msgspec.structs.asdict(self).items()
                                                                if v is not None}})
        if self.hlg is not None and base.hlg is not None:
            merged.hlg = self.hlg.over(base.hlg)  # knob by knob
        return merged

    def sampling(self) -> dict[str, float]:
        """The sampling values set here (as in_use merges them)."""
        return {k: float(v) for k in MLXD_DEFAULTS if (v := getattr(self, k)) is not None}

    @property
    def is_empty(self) -> bool:
        return all(v is None for v in msgspec.structs.asdict(self).values())


def in_use(model: dict[str, float], configured: Defaults | None = None) -> dict[str, float]:
    """What a request that sets no sampling gets: mlxd's config's values over the model's over mlxd's."""
    return {**MLXD_DEFAULTS, **model, **(configured.sampling() if configured is not None else {})}
