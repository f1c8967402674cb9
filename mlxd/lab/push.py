"""A push job: a model, adapter or dataset dir uploaded to the Hugging Face hub with huggingface_hub.

The repo is made when missing (`private` then; an existing repo keeps its visibility), and
the dir's files are one commit. The token comes in the worker's environment (HF_TOKEN, set by
the supervisor from `mlxd login`'s file), never in the job's files or its log; the hub is
HF_ENDPOINT's where that is set (a mirror, or a stand-in in tests).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from mlxd.lab.worker import Emit, JobError
from mlxd.protocol.jobs import Made, Progress, PushRequest, WorkerJob

SKIP = [".*", "**/.*", "*.partial*", "__pycache__/*"]  # hidden and half-written files stay home


def push(job: WorkerJob, emit: Emit) -> Made:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    req = msgspec.convert(job.request, PushRequest)
    source = Path(job.output_path)  # for a push: what it uploads
    if not source.is_dir():
        raise JobError(f"{source} is gone")
    files = [f for f in source.rglob("*") if f.is_file() and not any(p.startswith(".") for p in f.relative_to(source).parts)]
    size = sum(f.stat().st_size for f in files)
    api = HfApi(endpoint=job.hub_endpoint)
    repo_type = "dataset" if req.kind == "dataset" else "model"
    emit(Progress(stage="uploading", message=f"{len(files)} files, {size / 1e6:.1f} MB to {req.repo_id}"))
    try:
        repo = api.create_repo(req.repo_id, repo_type=repo_type, private=req.private, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(source), repo_id=req.repo_id, repo_type=repo_type, ignore_patterns=SKIP,
            commit_message=req.commit_message or f"Upload {req.kind} {req.name} from mlxd")
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise JobError(f"the hub refused the token ({status}): save a token with write access "
                           "(`mlxd login`)") from None
        raise JobError(f"the hub answered {status}: {exc}") from None
    url = str(getattr(repo, "url", "") or f"{api.endpoint}/{req.repo_id}")
    return Made(kind="upload", path=url, name=req.repo_id, details={
        "files": len(files), "size_bytes": size, "repo_type": repo_type,
        "commit": getattr(commit, "oid", None), "commit_url": getattr(commit, "commit_url", None)})
