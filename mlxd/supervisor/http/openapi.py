"""The OpenAPI 3.1 document of the supervisor's HTTP API, served at `GET /openapi.json`.

Schemas are the msgspec Structs the handlers decode requests with and encode answers from
(mlxd/protocol/), through `msgspec.json.schema_components` (JSON Schema 2020-12, which OpenAPI
3.1 uses as is), so a field or range added to a Struct reaches the document with no edit here.
One exception: a Response object is a dict, described field for field by protocol/responses.py's
ResponseObject (it says why).
The fuzz test (tests/integration/test_fuzz.py) checks real answers against the document.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from aiohttp import web

from mlxd import __version__
from mlxd.protocol import (
    anthropic,
    curve,
    embeddings,
    fit,
    jobs,
    ollama,
    ollama_answers,
    openai,
    responses,
)
from mlxd.protocol import supervisor_api as api
from mlxd.protocol.errors import ErrorBody
from mlxd.protocol.process import LEASE_HEADER
from mlxd.supervisor.http import adapter_routes as adapters
from mlxd.supervisor.http import admin_routes as admin
from mlxd.supervisor.http import lab_data_routes as lab
from mlxd.supervisor.lab_files import TokenState
from mlxd.supervisor.model_inspect import ModelInspection

SCHEMA_TYPES: tuple[Any, ...] = (
    openai.ChatCompletionRequest, openai.CompletionRequest, openai.ChatCompletion,
    openai.ChatCompletionChunk, openai.Completion, ErrorBody, admin.LoadBody, admin.UnloadBody,
    admin.DrainBody, admin.LeaseBody, admin.RenewBody, api.ModelInfoList, api.Health, api.EngineList,
    api.LoadAnswer, api.UnloadAnswer, api.DrainAnswer, api.Lease, api.LeaseList, api.LeaseDeleted,
    anthropic.MessagesRequest, anthropic.CountTokensRequest, anthropic.AnthropicMessage,
    anthropic.AnthropicErrorBody, anthropic.InputTokens, anthropic.ModelCardList, responses.ResponsesRequest, responses.ResponseObject,
    api.ResponseDeleted, api.InputItemList, api.TimelineView, adapters.LoadRequest, api.AdapterCardList,
    api.AdapterCard, api.AdapterUnloaded, jobs.FinetuneRequest, jobs.QuantizeRequest, jobs.Job, jobs.JobList,
    jobs.FuseRequest, jobs.MergeRequest, jobs.DatasetRequest, jobs.PushRequest, lab.InspectDatasetBody,
    lab.InspectModelBody, lab.TokenBody, lab.PushAliasBody, lab.DatasetInspection, lab.DatasetList, lab.TemplateList,
    TokenState, ModelInspection, ollama.ChatRequest, ollama.GenerateRequest, ollama.ModelRequest, ollama_answers.ChatLine,
    ollama_answers.GenerateLine, ollama_answers.OllamaError, ollama_answers.TagList, ollama_answers.RunningList, ollama_answers.ShowAnswer, ollama_answers.Version,
    ollama.PullRequest, ollama_answers.PullStatus, ollama.EmbedRequest, ollama_answers.EmbedAnswer,
    ollama_answers.LegacyEmbedding, embeddings.EmbeddingRequest, embeddings.EmbeddingList, fit.Library,
    api.CompactedResponse, curve.SignalRequest, curve.Signal, curve.GenerateRequest, curve.Generated,
)


def prompt_schema() -> dict[str, Any]:
    """CompletionRequest.prompt as the engine checks it (openai.completion_prompt): msgspec can't
    union two list types, so the Struct says only `str | list[Any]`."""
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    one = {"minItems": 1, "maxItems": 1}
    return {
        "anyOf": [{"type": "string"}, token_ids, {"type": "array", "items": {"type": "string"}, **one},
                  {"type": "array", "items": token_ids, **one}],
        "description": "Text, token ids, or a one-element list of either (one prompt per request).",
    }


# ---- operations ----

ERRORS = {
    400: "The body is not JSON, or a field has the wrong type or range (`param` names it); on any route, "
         "HTTP that cannot be parsed (`bad_http_request`).",
    401: "Keys are configured and the request carries none that is valid (admin routes: an admin key).",
    403: "A `Host` that does not name this server, or a browser `Origin` that is not allowed.",
    404: "No such model (the message lists some that exist), or no such lease.",
    408: "The request head or body arrived too slowly.",
    405: "A plain GET where a WebSocket upgrade is expected (use the upgrade, or POST).",
    409: "The model or the machine is leased, or the model is pinned.",
    413: "The body is larger than `server.max_body_bytes`.",
    415: "An admin POST without `Content-Type: application/json`.",
    500: "Generation raised in the engine (`generation_failed`); the engine keeps serving.",
    502: "The engine crashed while serving the request (`engine_crashed`).",
    503: "Too many connections, the model queue full or waited out, the model loading or failing, or "
         "mlxd stopping; `Retry-After` says when to try again.",
}
ANY = (400, 403, 408, 503)  # malformed HTTP, the Host check and connection limits: every route
GUARDED = (401, *ANY)
INFERENCE_ERRORS = (*GUARDED, 404, 413, 500, 502)
ADMIN_BODY_ERRORS = (*GUARDED, 404, 413, 415)


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def error_response(status: int, body: str = "ErrorBody") -> dict[str, Any]:
    """An error in OpenAI's `{"error": {...}}` shape (or Anthropic's, `body`)."""
    response: dict[str, Any] = {"description": ERRORS[status], "content": json_content(ref(body))}
    if status in (502, 503):
        response["headers"] = {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "string"}}}
    return response


def operation(
    op_id: str, summary: str, ok: dict[str, Any], errors: tuple[int, ...], *, tag: str,
    body: str | None = None, body_required: bool = True, parameters: list[dict[str, Any]] | None = None,
    error_body: str = "ErrorBody", status: int = 200,
) -> dict[str, Any]:
    """One OpenAPI operation; `ok` is the success answer's content (status `status`)."""
    op: dict[str, Any] = {"operationId": op_id, "summary": summary, "tags": [tag]}
    if parameters:
        op["parameters"] = parameters
    if body is not None:
        op["requestBody"] = {"required": body_required, "content": json_content(ref(body))}
    responses = {str(s): error_response(s, error_body) for s in sorted(errors)}
    described = {200: "OK", 202: "Accepted", 101: "Switching Protocols", 302: "Found"}.get(status, "OK")
    op["responses"] = {str(status): {"description": described, "content": ok},
                       **responses}
    return op


def inference(op_id: str, summary: str, body: str, answer: str, chunk: str) -> dict[str, Any]:
    """A relayed OpenAI route: JSON, or with `"stream": true` server-sent events."""
    lease = {"name": LEASE_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
             "description": "A model lease's id: the request is the lease holder's and runs on the leased model."}
    ok = {**json_content(ref(answer)), "text/event-stream": {"schema": event_schema(chunk)}}
    return operation(op_id, summary, ok, INFERENCE_ERRORS, tag="OpenAI", body=body, parameters=[lease])


def named_event_schema(description: str) -> dict[str, Any]:
    """One server-sent event with its `event:` name and a JSON `data:` line (Anthropic's, the Responses API's)."""
    return {"type": "object", "required": ["data"], "description": description,
            "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}


def event_schema(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream: a chunk, an error (the stream then ends), or `[DONE]`."""
    payload = {"contentMediaType": "application/json", "contentSchema": {"anyOf": [ref(chunk), ref("ErrorBody")]}}
    done_or_json = {"type": "string", "if": {"const": "[DONE]"}, "else": payload}
    return {"type": "object", "required": ["data"], "properties": {"data": done_or_json},
            "description": f"Each event: `data: {{{chunk}}}`; the last `data: [DONE]`, or an error after which "
                           "the stream closes."}


def response_id_param() -> dict[str, Any]:
    return {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


def lease_id_param() -> dict[str, Any]:
    return {"name": "lease_id", "in": "path", "required": True, "schema": {"type": "string"}}


def make_paths() -> dict[str, Any]:
    """Every route of the supervisor's TCP surface."""
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "/v1/chat/completions": {"post": inference(
            "createChatCompletion", "Chat completion, routed by `model` to that model's engine",
            "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk")},
        "/v1/completions": {"post": inference(
            "createCompletion", "Text completion (no chat template), routed by `model`",
            "CompletionRequest", "Completion", "Completion")},
        "/v1/embeddings": {"post": operation(
            "createEmbedding", "Vectors from an embedding model, routed by `model` (a generating model: 400)",
            json_content(ref("EmbeddingList")), INFERENCE_ERRORS, tag="OpenAI", body="EmbeddingRequest")},
        "/signal": {"post": operation(
            "curveSignal", "The curve designer's: where a prompt's next-token log-probabilities lie (80 bins over "
            "[-30, 0]) and the likeliest tokens, routed by `model` (docs/api.md#the-curve-sampler)",
            json_content(ref("Signal")), INFERENCE_ERRORS, tag="Curves", body="SignalRequest")},
        "/generate": {"post": operation(
            "curveGenerate", "The curve designer's: `n` samples under a curve (or the model's own sampling), "
            "routed by `model`", json_content(ref("Generated")), INFERENCE_ERRORS, tag="Curves",
            body="GenerateRequest")},
        "/curves": {"get": operation(
            "curveDesigner", "The curve designer: a redirect to the web page's Curves view (`/#curves`)",
            {"text/plain": {"schema": {"type": "string"}}}, GUARDED, tag="Curves", status=302)},
        "/library": {"get": operation(
            "library", "Every model on disk: whether it fits this machine, its decode speed predicted from the "
            "measured bandwidth and measured by mlxd (the first call waits up to `wait_s` for the bandwidth probe)",
            json_content(ref("Library")), (*GUARDED, 400), tag="Models",
            parameters=[{"name": "wait_s", "in": "query", "required": False,
                         "schema": {"type": "number", "minimum": 0, "maximum": 600}}])},
        "/v1/models": {"get": operation("listModels", "Every model that exists (Anthropic's list shape, "
                                        "ModelCardList, when `anthropic-version` is sent)",
                                        json_content({"anyOf": [ref("ModelInfoList"), ref("ModelCardList")]}),
                                        GUARDED, tag="OpenAI")},
        "/v1/responses": {"get": operation(
            "responsesSocket", "The Responses API over a WebSocket (a GET with `Upgrade: websocket`): a "
            "`response.create` message a turn, the stream's events back as JSON messages (docs/responses.md); "
            "a plain GET is a 405", {"application/json": {"schema": {"type": "object"}}}, (*GUARDED, 405),
            tag="Responses", status=101), "post": operation(
            "createResponse", "Responses API, translated onto the model's engine; stored for chaining "
            "(docs/responses.md)",
            {**json_content(ref("ResponseObject")), "text/event-stream": {"schema": named_event_schema(
                "The Responses events (response.created ... response.completed), each with its "
                "sequence_number; then `data: [DONE]`")}},
            INFERENCE_ERRORS, tag="Responses", body="ResponsesRequest")},
        "/v1/responses/compact": {"post": operation(
            "compactResponse", "The conversation so far (`previous_response_id`'s chain, then `input`) summarized "
            "by the model into a compaction item; `output` is the next turn's input (docs/responses.md)",
            json_content(ref("CompactedResponse")), INFERENCE_ERRORS, tag="Responses", body="ResponsesRequest")},
        "/v1/responses/{response_id}": {
            "get": operation("getResponse", "A stored response (`?stream=true`: as the events of a stream)",
                             json_content(ref("ResponseObject")), (*GUARDED, 404), tag="Responses",
                             parameters=[response_id_param(), {"name": "stream", "in": "query", "required": False,
                                                               "schema": {"type": "string", "enum": ["true", "false"]}}]),
            "delete": operation("deleteResponse", "Delete a stored response", json_content(ref("ResponseDeleted")),
                                (*GUARDED, 404), tag="Responses", parameters=[response_id_param()]),
        },
        "/v1/responses/{response_id}/input_items": {"get": operation(
            "listInputItems", "A stored response's own input items", json_content(ref("InputItemList")),
            (*GUARDED, 404), tag="Responses", parameters=[response_id_param(), *[
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "order", "in": "query", "required": False, "schema": {"type": "string", "enum": ["asc", "desc"]}},
                {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}]])},
        "/v1/messages": {"post": operation(
            "createMessage", "Anthropic Messages, translated onto the model's engine (docs/anthropic.md)",
            {**json_content(ref("AnthropicMessage")), "text/event-stream": {"schema": named_event_schema(
                "Anthropic's events: message_start, content_block_start/delta/stop, message_delta, "
                "message_stop, ping; error")}},
            INFERENCE_ERRORS, tag="Anthropic", body="MessagesRequest", error_body="AnthropicErrorBody")},
        "/v1/messages/count_tokens": {"post": operation(
            "countTokens", "The prompt a Messages request becomes, counted by the model's engine",
            json_content(ref("InputTokens")), INFERENCE_ERRORS, tag="Anthropic", body="CountTokensRequest",
            error_body="AnthropicErrorBody")},
        "/health": {"get": {**operation("health", "The supervisor is up (never needs a key)",
                                        json_content(ref("Health")), ANY, tag="Service"), "security": []}},
        "/metrics": {"get": operation("metrics", "Prometheus text format", text, GUARDED, tag="Service")},
        "/": {"get": {**operation("webPage", "The web page: dashboard and chat (docs/web.md; it asks for a key "
                                  "itself)", {"text/html": {"schema": {"type": "string"}}}, ANY, tag="Web"),
                      "security": []}},
        "/sw.js": {"get": {**operation("serviceWorker", "The web page's service worker (it caches the page's own "
                                       "files, never API traffic)", {"text/javascript": {"schema": {"type": "string"}}},
                                       ANY, tag="Web"), "security": []}},
        "/ui/{name}": {"get": {**operation(
            "webAsset", "A file of the web page (script, style sheet, icon, app manifest)",
            {t: {"schema": {"type": "string"}}
             for t in ("text/javascript", "text/css", "image/svg+xml", "application/manifest+json")},
            (*ANY, 404), tag="Web", parameters=[{"name": "name", "in": "path", "required": True,
                                                 "schema": {"type": "string"}}]), "security": []}},
        "/openapi.json": {"get": operation("openapi", "This document", json_content({"type": "object"}), GUARDED,
                                           tag="Service")},
        **make_admin_paths(),
        **make_adapter_paths(),
        **make_lab_paths(),
        **make_ollama_paths(),
    }


def make_ollama_paths() -> dict[str, Any]:
    """Ollama's API (docs/ollama.md): its own error shape (`{"error": "..."}`), NDJSON streams."""
    def op(op_id: str, summary: str, ok: dict[str, Any], errors: tuple[int, ...], body: str | None = None) -> Any:
        return operation(op_id, summary, ok, errors, tag="Ollama", body=body, error_body="OllamaError")

    def lines(line: str) -> dict[str, Any]:
        each = {"anyOf": [ref(line), ref("OllamaError")],
                "description": f"One JSON object a line ({line}); the last has `done: true`, or is an error."}
        return {**json_content(ref(line)), "application/x-ndjson": {"schema": each}}

    return {
        "/api/chat": {"post": op("ollamaChat", "Ollama's chat (streamed unless `stream: false`); no messages: "
                                 "load the model, or with `keep_alive: 0` unload it", lines("ChatLine"),
                                 INFERENCE_ERRORS, "ChatRequest")},
        "/api/generate": {"post": op("ollamaGenerate", "Ollama's generate (`raw`: no chat template); no prompt: "
                                     "load or unload the model", lines("GenerateLine"), INFERENCE_ERRORS,
                                     "GenerateRequest")},
        "/api/tags": {"get": op("ollamaTags", "Every model there is, in Ollama's shape", json_content(ref("TagList")),
                                GUARDED)},
        "/api/ps": {"get": op("ollamaRunning", "The models loaded, and when each unloads",
                              json_content(ref("RunningList")), GUARDED)},
        "/api/show": {"post": op("ollamaShow", "One model's details, parameters, chat template and capabilities",
                                 json_content(ref("ShowAnswer")), (*GUARDED, 404, 413), "ModelRequest")},
        "/api/version": {"get": op("ollamaVersion", "The Ollama API version these routes follow",
                                   json_content(ref("Version")), GUARDED)},
        "/api/embed": {"post": op("ollamaEmbed", "An embedding model's vectors (unit length) for `input`; no "
                                  "input loads the model", json_content(ref("EmbedAnswer")), INFERENCE_ERRORS,
                                  "EmbedRequest")},
        "/api/embeddings": {"post": op("ollamaEmbeddings", "The older embeddings route: one `prompt`'s vector",
                                       json_content(ref("LegacyEmbedding")), INFERENCE_ERRORS, "EmbedRequest")},
        "/api/pull": {"post": op("ollamaPull", "Fetch an MLX model (a Hugging Face repo id) into the hub cache, "
                                 "its progress streamed unless `stream: false` (an admin call)", lines("PullStatus"),
                                 (*GUARDED, 413), "PullRequest")},
        "/api/delete": {"delete": op("ollamaDelete", "Remove a model mlxd owns, its engine drained first (an admin "
                                     "call)", {}, (*GUARDED, 404, 409, 413, 500), "ModelRequest")},
    }


def make_lab_paths() -> dict[str, Any]:
    """/lab: fine-tune and quantize jobs (docs/lab.md), with the reference's /api/... aliases."""
    job = json_content(ref("Job"))
    id_param = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
    paths: dict[str, Any] = {}
    for path, op_id, summary, body in (
        ("/lab/fuse", "fuse", "Queue fusing an adapter into its model", "FuseRequest"),
        ("/api/finetune/export", "fuseAlias", "Queue fusing an adapter into its model", "FuseRequest"),
        ("/lab/merge", "merge", "Queue merging LoRA adapters into one", "MergeRequest"),
        ("/api/finetune/merge", "mergeAlias", "Queue merging LoRA adapters into one", "MergeRequest"),
    ):
        paths[path] = {"post": operation(op_id, summary, job, ADMIN_BODY_ERRORS, tag="Lab", body=body, status=202)}
    for prefix, submit, alias in (("/lab", "", ""), ("/api", "/submit", "Alias")):
        paths.update({
            f"{prefix}/finetune{submit}": {"post": operation(
                f"finetune{alias}", "Queue a LoRA/DoRA fine-tune (the dataset is checked first)", job,
                ADMIN_BODY_ERRORS, tag="Lab", body="FinetuneRequest", status=202)},
            f"{prefix}/quantize{submit}": {"post": operation(
                f"quantize{alias}", "Queue a quantization", job, ADMIN_BODY_ERRORS, tag="Lab",
                body="QuantizeRequest", status=202)},
            f"{prefix}/jobs": {"get": operation(f"listJobs{alias}", "The jobs, newest first",
                                                json_content(ref("JobList")), GUARDED, tag="Lab")},
            f"{prefix}/jobs/{{id}}": {"get": operation(f"getJob{alias}", "One job", job, (*GUARDED, 404), tag="Lab",
                                                       parameters=id_param)},
            f"{prefix}/jobs/{{id}}/stream": {"get": operation(
                f"streamJob{alias}", "The job as server-sent events (`event: job`) until it ends",
                {"text/event-stream": {"schema": {"type": "string"}}}, (*GUARDED, 404), tag="Lab",
                parameters=id_param)},
            f"{prefix}/jobs/{{id}}/cancel": {"post": operation(
                f"cancelJob{alias}", "Cancel a job", job, (*GUARDED, 404), tag="Lab", parameters=id_param)},
            f"{prefix}/jobs/{{id}}/log": {"get": operation(
                f"jobLog{alias}", "The worker's log (the last 1 MB)", {"text/plain": {"schema": {"type": "string"}}},
                (*GUARDED, 404), tag="Lab", parameters=id_param)},
        })
    paths.update(make_lab_data_paths())
    return paths


def make_lab_data_paths() -> dict[str, Any]:
    """/lab's routes around jobs: inspections, datasets, templates, the hub token, push."""
    job = json_content(ref("Job"))
    token = json_content(ref("TokenState"))
    paths: dict[str, Any] = {
        "/lab/datasets": {"get": operation("listDatasets", "The datasets in the datasets dir",
                                           json_content(ref("DatasetList")), GUARDED, tag="Lab")},
        "/lab/push": {"post": operation("push", "Queue uploading a model, adapter or dataset to the Hugging Face hub",
                                        job, ADMIN_BODY_ERRORS, tag="Lab", body="PushRequest", status=202)},
    }
    for kind in ("quantize", "finetune", "dataset"):
        paths[f"/api/{kind}/push"] = {"post": operation(
            f"push{kind.title()}Alias", "Queue uploading what a finished job made to the hub", job,
            ADMIN_BODY_ERRORS, tag="Lab", body="PushAliasBody", status=202)}
    for prefix, inspect, submit, alias in (("/lab", "/finetune/inspect", "", ""),
                                           ("/api", "/finetune/inspect-dataset", "/submit", "Alias")):
        paths.update({
            f"{prefix}{inspect}": {"post": operation(
                f"inspectDataset{alias}", "Each split file's rows, format and bad lines",
                json_content(ref("DatasetInspection")), ADMIN_BODY_ERRORS, tag="Lab", body="InspectDatasetBody")},
            f"{prefix}/quantize/inspect": {"post": operation(
                f"inspectModel{alias}", "A model's parameters and size, and what each bit width would weigh",
                json_content(ref("ModelInspection")), ADMIN_BODY_ERRORS, tag="Lab", body="InspectModelBody")},
            f"{prefix}/dataset/templates": {"get": operation(
                f"datasetTemplates{alias}", "What a dataset job can make", json_content(ref("TemplateList")),
                GUARDED, tag="Lab")},
            f"{prefix}/dataset{submit}": {"post": operation(
                f"makeDataset{alias}", "Queue a dataset job: a model writes rows by a template", job,
                ADMIN_BODY_ERRORS, tag="Lab", body="DatasetRequest", status=202)},
            f"{prefix}/settings/hf-token": {
                "get": operation(f"hfToken{alias}", "Whether a Hugging Face token is kept (never the token)", token,
                                 GUARDED, tag="Lab"),
                "post": operation(f"saveHfToken{alias}", "Keep a Hugging Face token (mode 0600)", token,
                                  ADMIN_BODY_ERRORS, tag="Lab", body="TokenBody"),
                "delete": operation(f"forgetHfToken{alias}", "Remove the kept token", token, GUARDED, tag="Lab"),
            },
        })
    return paths


def make_adapter_paths() -> dict[str, Any]:
    """/v1/adapters: LoRA adapters (docs/adapters.md); loading and unloading take an admin key."""
    listing = json_content(ref("AdapterCardList"))
    model_param = {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                   "description": "only the adapters made for this model"}
    id_param = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/adapters": {
            "get": operation("listAdapters", "Every adapter mlxd knows, and the models it is loaded on", listing,
                             GUARDED, tag="Adapters"),
            "post": operation("loadAdapter", "Load an adapter (by `id`, or the `path` of its dir) onto a model and "
                              "keep it loaded; answers once loaded", json_content(ref("AdapterCard")),
                              ADMIN_BODY_ERRORS, tag="Adapters", body="LoadRequest"),
        },
        "/v1/adapters/available": {"get": operation(
            "availableAdapters", "The adapters made for a model", listing, (*GUARDED, 404), tag="Adapters",
            parameters=[model_param])},
        "/v1/adapters/{id}": {"delete": operation(
            "unloadAdapter", "Unload an adapter from every model", json_content(ref("AdapterUnloaded")),
            (*GUARDED, 404), tag="Adapters", parameters=[id_param])},
    }


def make_admin_paths() -> dict[str, Any]:
    """The /admin routes: the model pool and job leases."""
    lease = json_content(ref("Lease"))
    return {
        "/admin/engines": {"get": operation("listEngines", "Every engine the pool has seen",
                                            json_content(ref("EngineList")), GUARDED, tag="Admin")},
        "/admin/timeline": {"get": operation("timeline", "Tokens, requests and time to first token per model "
                                             "over the last minutes (the web page's charts)",
                                             json_content(ref("TimelineView")), GUARDED, tag="Admin")},
        "/admin/load": {"post": operation("loadModel", "Start a model; answers once it is ready",
                                          json_content(ref("LoadAnswer")), ADMIN_BODY_ERRORS, tag="Admin",
                                          body="LoadBody")},
        "/admin/unload": {"post": operation("unloadModel", "Drain a model, then stop its engine",
                                            json_content(ref("UnloadAnswer")), (*ADMIN_BODY_ERRORS, 409), tag="Admin",
                                            body="UnloadBody")},
        "/admin/drain": {"post": operation("drain", "Drain one engine (or every ready one); they keep serving",
                                           json_content(ref("DrainAnswer")), ADMIN_BODY_ERRORS, tag="Admin",
                                           body="DrainBody", body_required=False)},
        "/admin/leases": {
            "get": operation("listLeases", "Held leases, then recently ended ones", json_content(ref("LeaseList")),
                             GUARDED, tag="Admin"),
            "post": operation("takeLease", "Take a model lease (or, with `model: null`, a machine lease); "
                              "answers once held", lease, (*ADMIN_BODY_ERRORS, 409), tag="Admin",
                              body="LeaseBody"),
        },
        "/admin/leases/{lease_id}/renew": {"post": operation(
            "renewLease", "Expire the lease `ttl_s` from now", lease, ADMIN_BODY_ERRORS, tag="Admin",
            body="RenewBody", body_required=False, parameters=[lease_id_param()])},
        "/admin/leases/{lease_id}": {"delete": operation(
            "endLease", "End a held lease", json_content(ref("LeaseDeleted")), (*GUARDED, 404), tag="Admin",
            parameters=[lease_id_param()])},
    }


def make_openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document (a fresh dict each call)."""
    _, schemas = msgspec.json.schema_components(SCHEMA_TYPES, ref_template="#/components/schemas/{name}")
    schemas["CompletionRequest"]["properties"]["prompt"] = prompt_schema()
    security_schemes = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer KEY`"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "mlxd", "version": __version__,
            "description": "A local LLM inference daemon on MLX: OpenAI's API, one engine process per model. "
                           "Keys are needed only when `api_keys`/`admin_keys` are configured; admin routes "
                           "then take an admin key. Errors are JSON in each API's own shape (OpenAI's; Anthropic's under "
                           "/v1/messages; Ollama's under /api/chat and its siblings).",
        },
        "paths": make_paths(),
        "components": {"schemas": schemas, "securitySchemes": security_schemes},
        "security": [{"bearer": []}, {"apiKey": []}],
    }


@functools.cache
def openapi_bytes() -> bytes:
    """The document as JSON, built once per process."""
    return msgspec.json.encode(make_openapi())


async def openapi_json(request: web.Request) -> web.Response:
    """GET /openapi.json: this API's OpenAPI 3.1 document."""
    return web.Response(body=openapi_bytes(), content_type="application/json")
