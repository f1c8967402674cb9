"""A dataset job: rows asked of a model through mlxd's own `/v1/chat/completions`, by a template.

The worker sends up to PARALLEL requests at once, so the engine's continuous batching makes
the rows together. Each answer is held to the template's JSON schema (structured output), so
it parses. A field that ran to its schema's length cap ends mid-sentence: it is cut back to
its last whole sentence. A row that repeats one already made, or that has no whole sentence
to keep, is asked again with another seed (up to RETRIES times). Rows go to train.jsonl, every k-th to valid.jsonl (at least one
each), written into a staging dir and moved into the datasets dir when all are made. No mlx
in this process: the model runs in mlxd's engine, like any client's.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import msgspec

from mlxd.lab.templates import Inputs, Row, Template, max_tokens_for, resolve_inputs
from mlxd.lab.worker import Emit, JobError, publish, staging_dir
from mlxd.protocol.jobs import DATASET_KEY_ENV, DatasetRequest, Made, Progress, WorkerJob

PARALLEL = 8
RETRIES = 4
REQUEST_TIMEOUT_S = 600.0


class Unusable(Exception):
    """This answer makes no row (cut short, not the schema's JSON): ask again."""


def dataset(job: WorkerJob, emit: Emit) -> Made:
    req = msgspec.convert(job.request, DatasetRequest)
    try:
        template, inputs = resolve_inputs(req.template, req.inputs)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    assert job.api_url is not None
    final = Path(job.output_path)
    staged = staging_dir(final)
    staged.mkdir(parents=True)
    emit(Progress(stage="generating", step=0, total=req.rows,
                  message=f"{req.rows} rows by template {req.template!r} from {req.model}"))
    rows = _make_rows(job.api_url, req, template, inputs, emit)
    n_valid = min(len(rows) - 1, max(1, round(len(rows) * req.valid_fraction)))
    every = len(rows) / n_valid
    valid_at = {int(k * every) for k in range(n_valid)}
    splits: dict[str, list[Row]] = {"train": [], "valid": []}
    for i, row in enumerate(rows):
        splits["valid" if i in valid_at else "train"].append(row)
    for split, split_rows in splits.items():
        with (staged / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in split_rows)
    emit(Progress(stage="saving", step=len(rows), total=req.rows, message=f"{final.name}: "
                  f"{len(splits['train'])} train rows, {len(splits['valid'])} valid rows"))
    publish(staged, final)
    return Made(kind="dataset", path=str(final), name=final.name, details={
        "template": req.template, "model": req.model, "format": template.info.format,
        "rows": {split: len(r) for split, r in splits.items()}})


def _make_rows(api_url: str, req: DatasetRequest, template: Template, inputs: Inputs, emit: Emit) -> list[Row]:
    """`req.rows` distinct rows, in the order of their indexes."""
    made: dict[int, Row] = {}
    seen: set[str] = set()
    tries = dict.fromkeys(range(req.rows), 0)
    todo = list(range(req.rows))[::-1]
    started, last_error = time.monotonic(), ""
    with ThreadPoolExecutor(PARALLEL, thread_name_prefix="row") as pool:
        running: dict[Future[Row], int] = {}
        while todo or running:
            while todo and len(running) < PARALLEL:
                i = todo.pop()
                running[pool.submit(_ask_row, api_url, req, template, inputs, i, tries[i])] = i
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                i = running.pop(future)
                try:
                    row = future.result()
                except Unusable as exc:
                    row, last_error = None, str(exc)
                if row is not None and template.key(row) not in seen:
                    seen.add(template.key(row))
                    made[i] = row
                    elapsed = time.monotonic() - started
                    emit(Progress(stage="generating", step=len(made), total=req.rows,
                                  eta_s=round(elapsed / len(made) * (req.rows - len(made)), 1)))
                    continue
                tries[i] += 1
                if tries[i] > RETRIES:
                    why = last_error or "its answers repeated rows made already"
                    raise JobError(f"row {i + 1}: no usable answer in {RETRIES + 1} tries ({why}); "
                                   "try a larger model, a higher temperature or fewer rows")
                todo.append(i)
    return [made[i] for i in sorted(made)]


def _ask_row(api_url: str, req: DatasetRequest, template: Template, inputs: Inputs, i: int, attempt: int) -> Row:
    prompt, schema = template.ask(inputs, i, req.rows)
    body = {
        "model": req.model,
        "messages": [{"role": "system", "content": "You write training data for a language model. "
                      "Every example is realistic, correct and different from the others."},
                     {"role": "user", "content": prompt}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "row", "schema": schema, "strict": True}},
        "max_tokens": max_tokens_for(schema),
        "temperature": req.temperature,
        "seed": req.seed + i + 7919 * attempt,
    }
    answer = _post(api_url + "/v1/chat/completions", body)
    choice = answer["choices"][0]
    if choice.get("finish_reason") != "stop":
        raise Unusable(f"an answer ended by {choice.get('finish_reason')!r}")
    try:
        parsed = json.loads(choice["message"]["content"] or "")
        for field, spec in schema["properties"].items():
            if "maxLength" in spec and len(parsed[field]) >= spec["maxLength"]:
                parsed[field] = _last_sentence(parsed[field], field)
        return template.row(inputs, parsed)
    except (ValueError, KeyError, TypeError) as exc:
        raise Unusable(f"an answer was not the template's JSON ({exc})") from None


def _last_sentence(text: str, field: str) -> str:
    """A field that ran to its length cap, cut back to its last whole sentence (past a third of
    it); Unusable when there is none."""
    ends = [i for i, c in enumerate(text) if c in ".!?" and (i + 1 == len(text) or text[i + 1].isspace())]
    if not ends or ends[-1] < len(text) // 3:
        raise Unusable(f"an answer's `{field}` ran to its length cap with no whole sentence to keep")
    return text[: ends[-1] + 1]


def _post(url: str, body: dict[str, Any]) -> Any:
    headers = {"Content-Type": "application/json"}
    if key := os.environ.get(DATASET_KEY_ENV):
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    for wait_s in (1, 2, 4, 8, 0):
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            if exc.code in (429, 503) and wait_s:  # busy or swapping: wait, then again
                time.sleep(wait_s)
                continue
            raise JobError(f"mlxd answered {exc.code}: {message}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            if wait_s:
                time.sleep(wait_s)
                continue
            raise JobError(f"cannot reach mlxd at {url}: {exc}") from None
    raise JobError("mlxd stayed busy")  # not reached: the last try raises


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return exc.reason or "no message"
