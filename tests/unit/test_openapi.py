"""The OpenAPI document: valid OpenAPI 3.1, every served route in it, schemas that match validation."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import schemathesis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode

from mlxd.protocol import anthropic, curve, ollama, openai, responses
from mlxd.protocol.json_body import decode_as
from mlxd.supervisor.config import Config
from mlxd.supervisor.engines.pool import Pool
from mlxd.supervisor.http import admin_routes as admin
from mlxd.supervisor.http.app import make_app
from mlxd.supervisor.http.openapi import make_openapi, openapi_bytes, openapi_json, prompt_schema
from mlxd.supervisor.registry import Registry
from mlxd.supervisor.relay.ollama_dialect import OLLAMA_PATHS

BODIES: dict[tuple[str, str], type[Any]] = {
    ("POST", "/v1/chat/completions"): openai.ChatCompletionRequest,
    ("POST", "/v1/completions"): openai.CompletionRequest,
    ("POST", "/v1/messages"): anthropic.MessagesRequest,
    ("POST", "/v1/messages/count_tokens"): anthropic.CountTokensRequest,
    ("POST", "/v1/responses"): responses.ResponsesRequest,
    ("POST", "/v1/responses/compact"): responses.ResponsesRequest,
    ("POST", "/signal"): curve.SignalRequest,
    ("POST", "/generate"): curve.GenerateRequest,
    ("POST", "/admin/load"): admin.LoadBody,
    ("POST", "/admin/unload"): admin.UnloadBody,
    ("POST", "/admin/drain"): admin.DrainBody,
    ("POST", "/admin/leases"): admin.LeaseBody,
    ("POST", "/admin/leases/{lease_id}/renew"): admin.RenewBody,
    ("POST", "/api/chat"): ollama.ChatRequest,
    ("POST", "/api/generate"): ollama.GenerateRequest,
    ("POST", "/api/show"): ollama.ModelRequest,
}


def documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item}


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = make_openapi()
    assert doc["openapi"] == "3.1.0"
    schemathesis.openapi.from_dict(doc).validate()  # against the OpenAPI 3.1 meta-schema


def test_every_route_the_supervisor_serves_is_documented(tmp_path: Path) -> None:
    app = make_app(Config(), Registry({}, models_dir=tmp_path, hf_cache=tmp_path), Pool(tmp_path))
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD" and r.resource}
    assert documented(make_openapi()) == served


def test_request_bodies_are_the_handlers_own_structs_as_json_schema() -> None:
    doc = make_openapi()
    for (method, path), kind in BODIES.items():
        body = doc["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{kind.__name__}"}
    _, expected = msgspec.json.schema_components(list(BODIES.values()), ref_template="#/components/schemas/{name}")
    expected["CompletionRequest"]["properties"]["prompt"] = prompt_schema()  # what the engine checks
    assert all(doc["components"]["schemas"][name] == schema for name, schema in expected.items())


def test_keys_are_documented_and_health_needs_none() -> None:
    doc = make_openapi()
    assert doc["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer KEY`"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    assert doc["security"] == [{"bearer": []}, {"apiKey": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []


def test_every_error_answer_is_json_in_the_routes_api() -> None:
    for path, item in make_openapi()["paths"].items():
        body = ("AnthropicErrorBody" if path.startswith("/v1/messages") else
                "OllamaError" if path in OLLAMA_PATHS else "ErrorBody")
        for method, op in item.items():
            for status, answer in op["responses"].items():
                if int(status) >= 400:
                    assert answer["content"] == {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}}, (method, path, status)


def _integral_floats_as_ints(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer; msgspec (rightly, for OpenAI's API) wants `1`."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e300:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    return value


@pytest.mark.parametrize(("method", "path"), list(BODIES))
def test_bodies_valid_by_the_document_pass_the_handlers_validation(method: str, path: str) -> None:
    operation = schemathesis.openapi.from_dict(make_openapi())[path][method]
    kind = BODIES[method, path]

    @settings(max_examples=40, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(GenerationMode.POSITIVE))
    def decodes(case: Case) -> None:
        if isinstance(case.body, dict):
            decode_as(json.dumps(_integral_floats_as_ints(case.body)).encode(), kind)

    decodes()


def test_the_handler_serves_the_document_as_json() -> None:
    async def fetch() -> tuple[int, str, bytes]:
        app = web.Application()
        app.router.add_get("/openapi.json", openapi_json)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/openapi.json")
            return resp.status, resp.content_type, await resp.read()

    status, content_type, body = asyncio.run(fetch())
    assert (status, content_type) == (200, "application/json")
    assert body == openapi_bytes() and json.loads(body) == make_openapi()


def test_the_document_is_built_without_importing_mlx() -> None:
    code = "import sys, mlxd.supervisor.http.openapi as o; o.openapi_bytes(); print(any(m.split('.')[0] == 'mlx' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
