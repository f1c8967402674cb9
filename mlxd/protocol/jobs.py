"""Lab jobs on the wire: what a job asks for, what its worker reports, and the job as stored.

A job is submitted to the supervisor (`POST /lab/finetune`, `/lab/quantize`; docs/lab.md), which
checks it, stores it (supervisor/jobs/store.py) and runs it in a worker process of its own
(`python -m mlxd.lab`, mlxd/lab/), never in the supervisor or an engine. The worker gets the
request with its paths resolved (`WorkerJob`) and reports on stdout, one JSON line each:
progress (`Progress`), then what it made (`Made`), or why it failed (`Failure`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Name = Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
ModelName = Annotated[str, Meta(min_length=1, max_length=1024)]
JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
JobKind = Literal["finetune", "quantize", "fuse", "merge", "dataset", "push"]
DATASET_KEY_ENV = "MLXD_JOB_API_KEY"  # a dataset job's key to its supervisor's /v1 (where keys are on)
AdapterName = Annotated[str, Meta(min_length=1, max_length=200)]


class FinetuneRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A LoRA or DoRA fine-tune of `model` on the mlx-lm dataset dir `data` (train.jsonl,
    valid.jsonl: chat `messages`, `prompt`/`completion`, or `text` rows), as `mlx_lm.lora
    --train` runs it; the adapter is written to the adapters dir as `name`."""

    model: ModelName
    data: Annotated[str, Meta(min_length=1, max_length=4096)]
    name: Name
    fine_tune_type: Literal["lora", "dora"] = "lora"
    iters: Annotated[int, Meta(ge=1, le=10_000_000)] = 1000
    batch_size: Annotated[int, Meta(ge=1, le=1024)] = 4
    learning_rate: Annotated[float, Meta(gt=0, le=1)] = 1e-5
    num_layers: Annotated[int, Meta(ge=-1, le=10_000)] = 16  # the last N layers (-1: all)
    rank: Annotated[int, Meta(ge=1, le=1024)] = 8
    scale: Annotated[float, Meta(gt=0, le=1e4)] = 20.0
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    max_seq_length: Annotated[int, Meta(ge=8, le=1 << 20)] = 2048
    mask_prompt: bool = False  # train on completions only
    steps_per_report: Annotated[int, Meta(ge=1)] = 10
    steps_per_eval: Annotated[int, Meta(ge=1)] = 200
    val_batches: Annotated[int, Meta(ge=-1)] = 25
    grad_checkpoint: bool = False
    seed: int = 0


class QuantizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`model` quantized to `bits`, written to the models dir as `name` (default: MODEL-Nbit).

    How (docs/lab.md): `mlx_lm.convert`'s round-to-nearest, uniform or by one of its
    mixed-precision `recipe`s; with `target_bpw`, mlx-lm's dynamic quantization (a layer's
    sensitivity measured on calibration text decides which layers get `high_bits`, until the
    model is at `target_bpw` bits per weight); with `method="gptq"`, mlx-lm's GPTQ (weights
    rounded to undo the error the layer's calibration inputs see). The last two read
    `calibration`: a dataset's name or dir, or a text file (default: mlx-lm's own calibration
    text, which mlx-lm downloads once). So do `method="awq"`, mlx-lm's AWQ (activation-aware
    scales and clipping, for the model types in AWQ_MODEL_TYPES), and `method="dwq"`, mlx-lm's
    DWQ (the quantized model's scales and biases trained, at `learning_rate`, to give the full
    model's outputs on the calibration text).
    """

    model: ModelName
    bits: Literal[2, 3, 4, 5, 6, 8] = 4
    group_size: Literal[32, 64, 128] = 64
    recipe: Literal["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"] | None = None
    method: Literal["convert", "dynamic", "gptq", "awq", "dwq"] | None = None  # default: dynamic with target_bpw, else convert
    target_bpw: Annotated[float, Meta(ge=1.5, le=16)] | None = None
    high_bits: Literal[3, 4, 5, 6, 8] | None = None  # dynamic: the sensitive layers' bits (default bits+1)
    # dynamic over several widths instead of bits and high_bits (lab/mixed_bits.py)
    candidate_bits: Annotated[list[Literal[2, 3, 4, 5, 6, 8]], Meta(min_length=2, max_length=6)] | None = None
    calibration: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    calibration_samples: Annotated[int, Meta(ge=1, le=4096)] = 128
    calibration_length: Annotated[int, Meta(ge=16, le=8192)] = 512
    learning_rate: Annotated[float, Meta(gt=0, le=1)] | None = None  # dwq (default DWQ_LEARNING_RATE, mlx-lm's)
    name: Name | None = None

    def how(self) -> str:
        """The method this request resolves to."""
        return self.method or ("dynamic" if self.target_bpw is not None else "convert")


CALIBRATED_METHODS = ("dynamic", "gptq", "awq", "dwq")  # the methods that read calibration text
# The model types mlx-lm's AWQ knows how to scale (mlx_lm.quant.awq.AWQ_MODEL_CONFIGS; a unit
# test keeps the two lists equal), so an AWQ job for another is refused before it is queued.
AWQ_MODEL_TYPES = ("llama", "mistral", "ministral3", "mistral3", "llava", "qwen2", "qwen3", "gemma3_text", "gemma3",
                   "deepseek_v2")
DWQ_LEARNING_RATE = 1e-6  # mlx_lm.quant.dwq's default


class FuseRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`adapter` fused into `model`'s weights as `mlx_lm.fuse` does, written to the models dir as
    `name` (default: MODEL-ADAPTER); `gguf` also writes a GGUF file of it (llama, mistral and
    mixtral models, mlx-lm's exporter); `dequantize` saves a quantized model's weights at full
    precision."""

    model: ModelName
    adapter: AdapterName
    name: Name | None = None
    dequantize: bool = False
    gguf: bool = False


class MergeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Adapters of one model merged into one adapter `name`: its update is the sum of theirs,
    each times its `scales` entry (default 1 each)."""

    adapters: Annotated[list[AdapterName], Meta(min_length=2, max_length=8)]
    scales: Annotated[list[Annotated[float, Meta(ge=-100, le=100)]], Meta(min_length=2, max_length=8)] | None = None
    name: Name


TemplateInput = str | int | float | bool
RepoId = Annotated[str, Meta(min_length=3, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")]


class DatasetRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A dataset made by asking `model` (through mlxd's own `/v1/chat/completions`) for `rows`
    rows by the template `template` (`GET /lab/dataset/templates`), filled with `inputs`;
    written to the datasets dir as `name` (train.jsonl, valid.jsonl), ready to fine-tune on."""

    template: Annotated[str, Meta(min_length=1, max_length=100)]
    model: ModelName
    name: Name
    rows: Annotated[int, Meta(ge=2, le=100_000)] = 100
    inputs: dict[str, TemplateInput] = msgspec.field(default_factory=dict)
    valid_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.1
    temperature: Annotated[float, Meta(ge=0, le=2)] = 0.9
    seed: int = 0


class PushRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A model, adapter or dataset of mlxd's dirs uploaded to the Hugging Face hub as `repo_id`
    (made when missing, `private` then), with the token `mlxd login` saved."""

    kind: Literal["model", "adapter", "dataset"]
    name: Annotated[str, Meta(min_length=1, max_length=1024)]
    repo_id: RepoId
    private: bool = False
    commit_message: Annotated[str, Meta(min_length=1, max_length=500)] | None = None


class WorkerJob(msgspec.Struct, kw_only=True):
    """What the worker process is given: the job, its request, and the paths resolved."""

    id: str
    kind: JobKind
    request: dict[str, Any]
    model_path: str | None = None
    data_path: str | None = None
    output_path: str  # where it writes what it makes (a temp dir beside it until it is done)
    base_model: str | None = None  # the model id an adapter records as its base
    adapter_paths: list[str] = msgspec.field(default_factory=list)  # a fuse's or a merge's adapters
    api_url: str | None = None  # a dataset job's mlxd (its key, where keys are on: MLXD_JOB_API_KEY)
    hub_endpoint: str | None = None  # a push's hub (its token: HF_TOKEN in the worker's environment)


class Progress(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="event", tag="progress"):
    """A worker's progress line (`"event": "progress"`)."""

    stage: str  # loading, checking, training, saving, quantizing, ...
    step: int | None = None
    total: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    trained_tokens: int | None = None
    eta_s: float | None = None
    message: str | None = None


class Made(msgspec.Struct, kw_only=True, tag_field="event", tag="made"):
    """A worker's last line when it succeeds: what it made, and where."""

    kind: Literal["adapter", "model", "dataset", "upload"]
    path: str
    name: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class Failure(msgspec.Struct, kw_only=True, tag_field="event", tag="failed"):
    """A worker's last line when the job cannot be done (bad input found late, an error)."""

    error: str


WorkerLine = Progress | Made | Failure
worker_line = msgspec.json.Decoder(Progress | Made | Failure)


class Job(msgspec.Struct, kw_only=True):
    """A job as `GET /lab/jobs/{id}` shows it."""

    id: str
    object: Literal["job"] = "job"
    kind: str
    state: JobState
    request: dict[str, Any]
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    pid: int | None = None
    progress: Progress | None = None
    losses: list[list[float]] = msgspec.field(default_factory=list)  # [step, train loss] as reported
    error: str | None = None
    result: Made | None = None
    log_path: str | None = None


class JobList(msgspec.Struct):
    data: list[Job]
    object: Literal["list"] = "list"
