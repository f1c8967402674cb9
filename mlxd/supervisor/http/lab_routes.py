"""The lab's routes: submit a fine-tune or a quantization, list jobs, follow one, cancel it.

Under `/lab/` (mlxd's own; docs/lab.md), with the reference's `/api/...` paths as aliases. All
take an admin key where keys are configured: a job reads paths on this machine and takes the
GPU. A submission is checked before it is queued (the model exists, the dataset's files and
every line of them, the output's name is free): what fails is a 400 naming it, and nothing is
queued.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from mlxd.protocol.datasets import DatasetError, check_dir
from mlxd.protocol.errors import APIError
from mlxd.protocol.jobs import (
    AWQ_MODEL_TYPES,
    CALIBRATED_METHODS,
    FINISHED,
    FinetuneRequest,
    FuseRequest,
    Job,
    JobList,
    MergeRequest,
    QuantizeRequest,
    WorkerJob,
)
from mlxd.protocol.json_body import decode_json
from mlxd.supervisor.adapters import AdapterEntry, is_for
from mlxd.supervisor.http.answers import json_answer
from mlxd.supervisor.http.keys import ADAPTERS, JOBS, LAB_FILES, REGISTRY
from mlxd.supervisor.model_inspect import InspectError, inspect_model
from mlxd.supervisor.registry import ModelEntry
from mlxd.supervisor.relay.ollama_dialect import OLLAMA_USER_PATHS
from mlxd.supervisor.relay.sse import SSE_HEADERS

LAB = "/lab"
STREAM_KEEPALIVE_S = 15.0
_finetune = msgspec.json.Decoder(FinetuneRequest)
_quantize = msgspec.json.Decoder(QuantizeRequest)
_fuse = msgspec.json.Decoder(FuseRequest)
_merge = msgspec.json.Decoder(MergeRequest)


def job_model(request: web.Request, name: str) -> ModelEntry:
    """The model a job names; an unknown one is a 400 (the job's input is bad, not the route)."""
    try:
        return request.app[REGISTRY].resolve(name)
    except APIError as err:
        raise APIError(400, err.message, param="model", code=err.code) from None


def free_path(path: Path, what: str) -> Path:
    """`path`, its parent made; a 400 when something is there already."""
    if path.exists():
        raise APIError(400, f"{what} {path.name!r} exists already ({path}); choose another name.", param="name",
                       code="name_taken")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _new_adapter_dir(request: web.Request, name: str) -> Path:
    """Where a job's new adapter `name` goes: the adapters dir; a 400 when the name is taken."""
    catalog = request.app[ADAPTERS]
    if catalog.adapters_dir is None:
        raise APIError(503, "This supervisor has no adapters dir.", type="server_error")
    if catalog.find(name) is not None:
        raise APIError(400, f"Adapter {name!r} exists already; choose another name.", param="name",
                       code="name_taken")
    return free_path(catalog.adapters_dir / name, "Adapter")


def dataset_dir(request: web.Request, data: str) -> Path:
    """The dir a fine-tune's `data` names: a dataset of the datasets dir by its name, else a path."""
    if "/" not in data and (named := request.app[LAB_FILES].dataset_path(data)) is not None:
        return named
    return Path(data).expanduser()


async def finetune(request: web.Request, raw: bytes | None = None) -> web.Response:
    """POST /lab/finetune: queue a LoRA/DoRA fine-tune; its job, queued."""
    req: FinetuneRequest = decode_json(_finetune, raw if raw is not None else await request.read())
    entry = job_model(request, req.model)
    data = dataset_dir(request, req.data)
    try:
        await asyncio.get_running_loop().run_in_executor(None, check_dir, data)
    except DatasetError as exc:
        raise APIError(400, f"The dataset cannot be trained on: {exc}", param="data", code="dataset_invalid") from None
    out = _new_adapter_dir(request, req.name)
    request_dict = msgspec.to_builtins(req)
    job = request.app[JOBS].submit("finetune", request_dict, lambda job_id: WorkerJob(
        id=job_id, kind="finetune", request=request_dict, model_path=str(entry.path), data_path=str(data.resolve()),
        output_path=str(out), base_model=entry.id))
    return json_answer(job, 202)


async def quantize(request: web.Request, raw: bytes | None = None) -> web.Response:
    """POST /lab/quantize: queue a quantization; its job, queued."""
    req: QuantizeRequest = decode_json(_quantize, raw if raw is not None else await request.read())
    entry = job_model(request, req.model)
    config = _read_json(entry.path / "config.json")
    if isinstance(config, dict) and (config.get("quantization") or config.get("quantization_config")):
        raise APIError(400, f"{entry.id} is quantized already; quantize a full-precision model.", param="model",
                       code="already_quantized")
    calibration = _check_method(request, entry, req, config if isinstance(config, dict) else {})
    models_dir = request.app[REGISTRY].models_dir
    method = req.how()
    how = f"{req.target_bpw:g}bpw" if method == "dynamic" else f"{method}-{req.bits}bit" if method in CALIBRATED_METHODS \
        else req.recipe or f"{req.bits}bit"
    name = req.name or f"{entry.id.rpartition('/')[2]}-{how}"
    out = free_path(models_dir / name, "Model")
    request_dict = msgspec.to_builtins(req)
    job = request.app[JOBS].submit("quantize", request_dict, lambda job_id: WorkerJob(
        id=job_id, kind="quantize", request=request_dict, model_path=str(entry.path), output_path=str(out),
        base_model=entry.id, data_path=calibration))
    return json_answer(job, 202)


def _check_method(request: web.Request, entry: ModelEntry, req: QuantizeRequest,
                  config: dict[str, Any]) -> str | None:
    """A 400 for options that do not go together (`config`: the model's config.json); the
    calibration source's path, if any."""
    method = req.how()
    if method == "dynamic" and req.target_bpw is None:
        raise APIError(400, "Dynamic quantization needs `target_bpw` (bits per weight to reach).", param="target_bpw")
    if method != "dynamic" and req.target_bpw is not None:
        raise APIError(400, f"`target_bpw` is for dynamic quantization, not {method}.", param="target_bpw")
    if method != "convert" and req.recipe is not None:
        raise APIError(400, f"`recipe` is for convert, not {method} quantization.", param="recipe")
    if method != "dwq" and req.learning_rate is not None:
        raise APIError(400, f"`learning_rate` is for DWQ, not {method} quantization.", param="learning_rate")
    if method == "dwq" and req.bits == 8:
        raise APIError(400, "DWQ trains the scales of layers below 8 bits; at 8 bits it has nothing to learn "
                       "(quantize to 8 bits with the default method).", param="bits")
    if method == "awq":
        model_type = config.get("model_type")
        if model_type not in AWQ_MODEL_TYPES:
            raise APIError(400, f"AWQ does not know {entry.id}'s model type ({model_type or 'none given'}); it takes "
                           f"{', '.join(AWQ_MODEL_TYPES)}. GPTQ or dynamic quantization take any model.",
                           param="method", code="method_unsupported")
    if req.candidate_bits is not None:
        if method != "dynamic":
            raise APIError(400, f"`candidate_bits` is for dynamic quantization (with `target_bpw`), not {method}.",
                           param="candidate_bits")
        if len(set(req.candidate_bits)) != len(req.candidate_bits):
            raise APIError(400, "`candidate_bits` names a width twice.", param="candidate_bits")
        if req.high_bits is not None:
            raise APIError(400, "`high_bits` and `candidate_bits` both say which widths to use; give one.",
                           param="high_bits")
    if method == "dynamic":
        assert req.target_bpw is not None
        low = min(req.candidate_bits) if req.candidate_bits else req.bits
        high = max(req.candidate_bits) if req.candidate_bits else req.high_bits or min(8, req.bits + 1)
        if high <= low:
            raise APIError(400, f"`high_bits` ({high}) must be more than `bits` ({low}).", param="high_bits")
        low_bpw, high_bpw = _bpw_range(entry, low, high, req.group_size)
        if not low_bpw < req.target_bpw < high_bpw:
            raise APIError(400, f"`target_bpw` {req.target_bpw:g} is out of reach: {entry.id} at {low} bits is "
                           f"{low_bpw:.2f} bits per weight, at {high} bits {high_bpw:.2f} (scales and biases "
                           "included).", param="target_bpw")
    if req.calibration is None:
        return None
    if method == "convert":
        raise APIError(400, f"`calibration` is read by {', '.join(CALIBRATED_METHODS)} quantization only.",
                       param="calibration")
    path = dataset_dir(request, req.calibration)
    if not path.exists():
        raise APIError(400, f"Calibration {req.calibration[:200]!r} is neither a dataset nor a file or dir.",
                       param="calibration", code="calibration_not_found")
    return str(path.resolve())


def _bpw_range(entry: ModelEntry, low: int, high: int, group_size: int) -> tuple[float, float]:
    """The bits per weight of `entry` with every layer at `low` bits, and at `high` bits."""
    try:
        estimates = {e.bits: e.bits_per_weight for e in inspect_model(entry.id, entry.path, group_size).estimates}
    except InspectError as exc:
        raise APIError(400, f"{entry.id} cannot be inspected: {exc}", param="model", code="model_invalid") from None
    return estimates[low], estimates[high]


def _adapter(request: web.Request, name: str, model: ModelEntry | None) -> AdapterEntry:
    """A known adapter (for `model`, when given); a 400 naming it otherwise."""
    found = request.app[ADAPTERS].find(name)
    if found is None:
        raise APIError(400, f"Adapter {name[:200]!r} not found.", param="adapter", code="adapter_not_found")
    if model is not None and not is_for(found, model, request.app[REGISTRY]):
        raise APIError(400, f"Adapter {name!r} is for {found.base_model}, not {model.id}.", param="adapter",
                       code="adapter_base_mismatch")
    return found


async def fuse(request: web.Request, raw: bytes | None = None) -> web.Response:
    """POST /lab/fuse: queue fusing an adapter into its model (a new model); its job, queued."""
    req: FuseRequest = decode_json(_fuse, raw if raw is not None else await request.read())
    entry = job_model(request, req.model)
    adapter = _adapter(request, req.adapter, entry)
    name = req.name or f"{entry.id.rpartition('/')[2]}-{adapter.id}"
    out = free_path(request.app[REGISTRY].models_dir / name, "Model")
    body = msgspec.to_builtins(req)
    job = request.app[JOBS].submit("fuse", body, lambda job_id: WorkerJob(
        id=job_id, kind="fuse", request=body, model_path=str(entry.path), output_path=str(out),
        base_model=entry.id, adapter_paths=[str(adapter.path)]))
    return json_answer(job, 202)


async def merge(request: web.Request, raw: bytes | None = None) -> web.Response:
    """POST /lab/merge: queue merging adapters of one model into one; its job, queued."""
    req: MergeRequest = decode_json(_merge, raw if raw is not None else await request.read())
    if req.scales is not None and len(req.scales) != len(req.adapters):
        raise APIError(400, f"{len(req.scales)} scales for {len(req.adapters)} adapters.", param="scales")
    adapters = [_adapter(request, name, None) for name in req.adapters]
    if (other := next((a for a in adapters if a.kind != "lora"), None)) is not None:
        raise APIError(400, f"Only LoRA adapters merge; {other.id} is a {other.kind} adapter.",
                       param="adapters", code="adapter_invalid")
    bases = {a.base_model for a in adapters}
    if len(bases) > 1:
        raise APIError(400, f"The adapters are for different models ({', '.join(sorted(map(str, bases)))}).",
                       param="adapters", code="adapter_base_mismatch")
    out = _new_adapter_dir(request, req.name)
    body = msgspec.to_builtins(req)
    job = request.app[JOBS].submit("merge", body, lambda job_id: WorkerJob(
        id=job_id, kind="merge", request=body, output_path=str(out), base_model=adapters[0].base_model,
        adapter_paths=[str(a.path) for a in adapters]))
    return json_answer(job, 202)


def _job(request: web.Request) -> Job:
    job_id = request.match_info["id"]
    job = request.app[JOBS].store.get(job_id)
    if job is None:
        raise APIError(404, f"No job {job_id[:100]!r}.", param="id", code="job_not_found")
    return job


async def list_jobs(request: web.Request) -> web.Response:
    """GET /lab/jobs[?kind=K&limit=N]: the newest jobs first."""
    try:
        limit = max(1, min(1000, int(request.query.get("limit", "50"))))
    except ValueError:
        raise APIError(400, "`limit` must be an integer.", param="limit") from None
    return json_answer(JobList(request.app[JOBS].store.recent(limit, request.query.get("kind"))))


async def get_job(request: web.Request) -> web.Response:
    return json_answer(_job(request))


async def stream_job(request: web.Request) -> web.StreamResponse:
    """GET /lab/jobs/{id}/stream: the job as SSE (`event: job`), sent at every change until it ends."""
    job = _job(request)
    runner = request.app[JOBS]
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    last = b""
    while True:
        body = msgspec.json.encode(job)
        if body != last:
            await resp.write(b"event: job\ndata: " + body + b"\n\n")
            last = body
        else:
            await resp.write(b": waiting\n\n")
        if job.state in FINISHED:
            break
        found = await runner.changes(job.id, STREAM_KEEPALIVE_S)
        if found is None:
            break
        job = found
    await resp.write_eof()
    return resp


async def cancel_job(request: web.Request) -> web.Response:
    """POST /lab/jobs/{id}/cancel: a queued job never starts; a running one's worker is stopped."""
    job = _job(request)
    return json_answer(await request.app[JOBS].cancel(job.id))


async def job_log(request: web.Request) -> web.Response:
    """GET /lab/jobs/{id}/log: the worker's output (mlx-lm's own, tracebacks), the last 1 MB."""
    job = _job(request)
    try:
        data = Path(job.log_path or "").read_bytes()[-(1 << 20):]
    except OSError:
        data = b""
    return web.Response(body=data, content_type="text/plain", charset="utf-8")


def _read_json(path: Path) -> Any:
    try:
        return msgspec.json.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


# The reference's field names on its /api/... paths, and mlxd's for them.
FINETUNE_FIELDS = {"model_dir": "model", "data_dir": "data", "model_id": "model", "lora_rank": "rank",
                   "lora_layers": "num_layers", "lr": "learning_rate"}
QUANTIZE_FIELDS = {"model_id": "model", "model_dir": "model", "n_calibration": "calibration_samples"}
FUSE_FIELDS = {"base_model": "model", "adapter_path": "adapter"}


def reference_body(raw: bytes, fields: dict[str, str]) -> bytes:
    """A reference request's body with mlxd's field names; a fine-tune's `adapter_path` names
    the adapter by its last part. Anything else is left for the decoder to check."""
    try:
        body = msgspec.json.decode(raw or b"{}")
    except msgspec.DecodeError:
        return raw  # the decoder says what is wrong with it
    if not isinstance(body, dict):
        return raw
    renamed = {fields.get(k, k): v for k, v in body.items() if not (k in fields and fields[k] in body)}
    if isinstance(path := renamed.pop("adapter_path", None), str) and "name" not in renamed:
        renamed["name"] = Path(path.rstrip("/")).name
    if isinstance(adapter := renamed.get("adapter"), str) and "/" in adapter:
        renamed["adapter"] = Path(adapter.rstrip("/")).name  # an adapter dir of the adapters dir, by its name
    if "adapter_a" in renamed or "adapter_b" in renamed:
        renamed["adapters"] = [renamed.pop("adapter_a", None), renamed.pop("adapter_b", None)]
        renamed.setdefault("name", f"merged-{int(time.time())}")
    renamed.pop("method", None)  # the reference's export method: mlxd's fuse is mlx-lm's
    return msgspec.json.encode(renamed)


async def finetune_alias(request: web.Request) -> web.Response:
    """POST /api/finetune/submit: the reference's fine-tune (`model_dir`, `data_dir`, `adapter_path`)."""
    return await finetune(request, reference_body(await request.read(), FINETUNE_FIELDS))


async def quantize_alias(request: web.Request) -> web.Response:
    """POST /api/quantize/submit: the reference's quantization (`model_id`, `n_calibration`)."""
    return await quantize(request, reference_body(await request.read(), QUANTIZE_FIELDS))


async def fuse_alias(request: web.Request) -> web.Response:
    """POST /api/finetune/export: the reference's export (`base_model`, `adapter_path`)."""
    return await fuse(request, reference_body(await request.read(), FUSE_FIELDS))


async def merge_alias(request: web.Request) -> web.Response:
    """POST /api/finetune/merge: the reference's merge (`adapter_a`, `adapter_b`, `scales`)."""
    return await merge(request, reference_body(await request.read(), {}))


def setup_lab_routes(app: web.Application) -> None:
    app.router.add_post(f"{LAB}/fuse", fuse)
    app.router.add_post("/api/finetune/export", fuse_alias)
    app.router.add_post(f"{LAB}/merge", merge)
    app.router.add_post("/api/finetune/merge", merge_alias)
    app.router.add_post(f"{LAB}/finetune", finetune)
    app.router.add_post(f"{LAB}/quantize", quantize)
    app.router.add_post("/api/finetune/submit", finetune_alias)
    app.router.add_post("/api/quantize/submit", quantize_alias)
    for prefix in (LAB, "/api"):
        app.router.add_get(f"{prefix}/jobs", list_jobs)
        app.router.add_get(f"{prefix}/jobs/{{id}}", get_job)
        app.router.add_get(f"{prefix}/jobs/{{id}}/stream", stream_job)
        app.router.add_post(f"{prefix}/jobs/{{id}}/cancel", cancel_job)
        app.router.add_get(f"{prefix}/jobs/{{id}}/log", job_log)


def is_lab_route(request: web.Request) -> bool:
    """The admin calls under /lab/* and /api/* (the reference's lab routes, and Ollama's that
    change what is on disk); Ollama's inference and listing routes take any key."""
    return request.path.startswith((LAB + "/", "/api/")) and request.path not in OLLAMA_USER_PATHS
