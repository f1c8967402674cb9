"""The lab's routes around jobs: inspect a dataset or a model before a job, list datasets and
dataset templates, make a dataset, keep the Hugging Face token, push to the hub.

Under `/lab/` like the job routes (lab_routes.py; admin, docs/lab.md), with the reference's
`/api/...` paths as aliases where it has them (`/api/finetune/inspect-dataset` takes `path`,
`/api/quantize/inspect` takes `model_id`, as it did).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from mlxd.lab.templates import TEMPLATES, TemplateError, TemplateInfo, resolve_inputs
from mlxd.protocol.datasets import SPLITS, DatasetError, FileReport, check_dir, check_file
from mlxd.protocol.errors import APIError
from mlxd.protocol.jobs import DatasetRequest, PushRequest, WorkerJob
from mlxd.protocol.json_body import decode_json
from mlxd.supervisor.http.answers import json_answer
from mlxd.supervisor.http.keys import ADAPTERS, JOBS, LAB_FILES
from mlxd.supervisor.http.lab_routes import LAB, dataset_dir, free_path, job_model
from mlxd.supervisor.http.relaying import resolve_target
from mlxd.supervisor.lab_files import DatasetInfo, check_token
from mlxd.supervisor.model_inspect import InspectError, inspect_model

_dataset = msgspec.json.Decoder(DatasetRequest)
_push = msgspec.json.Decoder(PushRequest)


class InspectDatasetBody(msgspec.Struct, kw_only=True):
    """POST /lab/finetune/inspect (the alias /api/finetune/inspect-dataset takes `path`)."""

    data: str  # a dataset's name, or a dir


class InspectModelBody(msgspec.Struct, kw_only=True):
    """POST /lab/quantize/inspect (the alias /api/quantize/inspect takes `model_id`)."""

    model: str
    group_size: int = 64


class TokenBody(msgspec.Struct, kw_only=True):
    token: str


class PushAliasBody(msgspec.Struct, kw_only=True):
    """The reference's /api/{quantize|finetune|dataset}/push: what job `job_id` made."""

    job_id: str
    repo_id: str
    private: bool = False


class DatasetInspection(msgspec.Struct, kw_only=True):
    object: str = "dataset.inspection"
    path: str
    ok: bool
    error: str | None = None
    files: list[FileReport] = msgspec.field(default_factory=list)


class DatasetList(msgspec.Struct):
    data: list[DatasetInfo]
    object: str = "list"


class TemplateList(msgspec.Struct):
    data: list[TemplateInfo]
    object: str = "list"


_object = msgspec.json.Decoder(dict[str, Any])


def _body(raw: bytes) -> dict[str, Any]:
    """A JSON object body (an empty body: {})."""
    return decode_json(_object, raw or b"{}")


def _string(body: dict[str, Any], *names: str) -> str:
    for name in names:
        value = body.get(name)
        if isinstance(value, str) and value:
            return value
    raise APIError(400, f"`{names[0]}` must be a non-empty string.", param=names[0])


async def inspect_dataset(request: web.Request) -> web.Response:
    """POST /lab/finetune/inspect {"data"}: each split file's rows, format and bad lines."""
    path = dataset_dir(request, _string(_body(await request.read()), "data", "path"))
    loop = asyncio.get_running_loop()
    try:
        files = await loop.run_in_executor(None, check_dir, path)
        return json_answer(DatasetInspection(path=str(path), ok=True, files=files))
    except DatasetError as exc:
        def reports() -> list[FileReport]:  # what can be read, beside why it cannot be trained on
            out = []
            for split in SPLITS:
                if (path / f"{split}.jsonl").is_file():
                    try:
                        out.append(check_file(path / f"{split}.jsonl", split))
                    except DatasetError:
                        continue
            return out

        files = await loop.run_in_executor(None, reports) if path.is_dir() else []
        return json_answer(DatasetInspection(path=str(path), ok=False, error=str(exc), files=files))


async def inspect_quantize(request: web.Request) -> web.Response:
    """POST /lab/quantize/inspect {"model", "group_size"?}: its parameters and size, and what
    each bit width would weigh."""
    body = _body(await request.read())
    entry = job_model(request, _string(body, "model", "model_id"))
    group_size = body.get("group_size", 64)
    if group_size not in (32, 64, 128):
        raise APIError(400, "`group_size` must be 32, 64 or 128.", param="group_size")
    try:
        found = await asyncio.get_running_loop().run_in_executor(None, inspect_model, entry.id, entry.path, group_size)
    except InspectError as exc:
        raise APIError(400, f"{entry.id} cannot be inspected: {exc}", param="model", code="model_invalid") from None
    return json_answer(found)


async def list_datasets(request: web.Request) -> web.Response:
    """GET /lab/datasets: the datasets of the datasets dir (made by dataset jobs, or put there)."""
    found = await asyncio.get_running_loop().run_in_executor(None, request.app[LAB_FILES].datasets)
    return json_answer(DatasetList(found))


async def list_templates(request: web.Request) -> web.Response:
    """GET /lab/dataset/templates: what a dataset job can make."""
    return json_answer(TemplateList([t.info for t in TEMPLATES.values()]))


async def make_dataset(request: web.Request) -> web.Response:
    """POST /lab/dataset: queue a dataset job; its job, queued."""
    req: DatasetRequest = decode_json(_dataset, await request.read())
    try:
        resolve_inputs(req.template, req.inputs)
    except TemplateError as exc:
        raise APIError(400, str(exc), param="inputs" if req.template in TEMPLATES else "template",
                       code="template_invalid") from None
    try:  # the model (and a `base:adapter` form's adapter) as the job's own requests will resolve it
        resolve_target(request, req.model, None)
    except APIError as err:
        raise APIError(400, err.message, param="model", code=err.code) from None
    lab = request.app[LAB_FILES]
    if lab.datasets_dir is None:
        raise APIError(503, "This supervisor has no datasets dir.", type="server_error")
    if lab.dataset_path(req.name) is not None:
        raise APIError(400, f"Dataset {req.name!r} exists already; choose another name.", param="name",
                       code="name_taken")
    out = free_path(lab.datasets_dir / req.name, "Dataset")
    body = msgspec.to_builtins(req)
    api_url = _own_url(request)
    job = request.app[JOBS].submit("dataset", body, lambda job_id: WorkerJob(
        id=job_id, kind="dataset", request=body, output_path=str(out), api_url=api_url))
    return json_answer(job, 202)


def _own_url(request: web.Request) -> str:
    """Where this supervisor answers: the local address the request came in on."""
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    if not sock or not isinstance(sock, tuple):
        raise APIError(503, "The supervisor's own address is unknown.", type="server_error")
    host, port = sock[0], sock[1]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def push(request: web.Request) -> web.Response:
    """POST /lab/push: queue uploading a model, adapter or dataset to the hub; its job, queued."""
    return _queue_push(request, decode_json(_push, await request.read()))


def _queue_push(request: web.Request, req: PushRequest) -> web.Response:
    lab = request.app[LAB_FILES]
    if lab.token() is None:
        raise APIError(400, "No Hugging Face token: save one with `mlxd login` (or POST /lab/settings/hf-token).",
                       param="token", code="hf_token_missing")
    source = _push_source(request, req)
    body = msgspec.to_builtins(req)
    endpoint = os.environ.get("HF_ENDPOINT")
    job = request.app[JOBS].submit("push", body, lambda job_id: WorkerJob(
        id=job_id, kind="push", request=body, output_path=str(source), hub_endpoint=endpoint))
    return json_answer(job, 202)


async def push_alias(request: web.Request) -> web.Response:
    """POST /api/{quantize|finetune|dataset}/push {job_id, repo_id, private}: the reference's push,
    of what a finished job made."""
    body = _body(await request.read())
    job_id = _string(body, "job_id")
    job = request.app[JOBS].store.get(job_id)
    if job is None or job.result is None:
        raise APIError(400, f"Job {job_id[:100]!r} made nothing to push.", param="job_id", code="job_not_found")
    kind = {"model": "model", "adapter": "adapter", "dataset": "dataset"}.get(job.result.kind)
    if kind is None:
        raise APIError(400, f"Job {job_id!r} made nothing to push.", param="job_id")
    translated = {"kind": kind, "name": job.result.name, "repo_id": body.get("repo_id"),
                  "private": bool(body.get("private", False))}
    return _queue_push(request, decode_json(_push, msgspec.json.encode(translated)))


def _push_source(request: web.Request, req: PushRequest) -> Path:
    if req.kind == "model":
        entry = job_model(request, req.name)
        return entry.path
    if req.kind == "adapter":
        found = request.app[ADAPTERS].find(req.name)
        if found is None:
            raise APIError(400, f"Adapter {req.name[:200]!r} not found.", param="name", code="adapter_not_found")
        return Path(found.path)
    path = request.app[LAB_FILES].dataset_path(req.name)
    if path is None:
        raise APIError(400, f"Dataset {req.name[:200]!r} not found (GET /lab/datasets lists them).", param="name",
                       code="dataset_not_found")
    return path


async def token_state(request: web.Request) -> web.Response:
    """GET /lab/settings/hf-token: whether a token is kept (never the token)."""
    return json_answer(request.app[LAB_FILES].token_state())


async def save_token(request: web.Request) -> web.Response:
    """POST /lab/settings/hf-token {"token"}: keep it (mode 0600)."""
    body = _body(await request.read())
    try:
        token = check_token(body.get("token"))
    except ValueError as exc:
        raise APIError(400, str(exc), param="token") from None
    try:
        await asyncio.get_running_loop().run_in_executor(None, request.app[LAB_FILES].save_token, token)
    except OSError as exc:
        raise APIError(500, f"The token cannot be saved: {exc.strerror or exc}", type="server_error") from None
    return json_answer(request.app[LAB_FILES].token_state())


async def forget_token(request: web.Request) -> web.Response:
    """DELETE /lab/settings/hf-token: remove the kept token."""
    request.app[LAB_FILES].forget_token()
    return json_answer(request.app[LAB_FILES].token_state())


def setup_lab_data_routes(app: web.Application) -> None:
    for prefix, inspect_data, submit in ((LAB, "/finetune/inspect", ""), ("/api", "/finetune/inspect-dataset", "/submit")):
        app.router.add_post(f"{prefix}{inspect_data}", inspect_dataset)
        app.router.add_post(f"{prefix}/quantize/inspect", inspect_quantize)
        app.router.add_get(f"{prefix}/dataset/templates", list_templates)
        app.router.add_post(f"{prefix}/dataset{submit}", make_dataset)
        app.router.add_get(f"{prefix}/settings/hf-token", token_state)
        app.router.add_post(f"{prefix}/settings/hf-token", save_token)
        app.router.add_delete(f"{prefix}/settings/hf-token", forget_token)
    app.router.add_get(f"{LAB}/datasets", list_datasets)
    app.router.add_post(f"{LAB}/push", push)
    for kind in ("quantize", "finetune", "dataset"):
        app.router.add_post(f"/api/{kind}/push", push_alias)
