"""The supervisor's own answers are the Structs the OpenAPI document describes: each route's
answer decodes as its documented Struct, with no field missing, renamed or added."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from mlxd.protocol import anthropic, sampling
from mlxd.protocol import supervisor_api as api
from mlxd.protocol.process import DrainResult
from mlxd.supervisor.config import Config, PoolConfig
from mlxd.supervisor.engines.pool import Pool
from mlxd.supervisor.http.app import make_app
from mlxd.supervisor.http.keys import TIMELINE
from mlxd.supervisor.http.openapi import make_openapi
from mlxd.supervisor.registry import Registry

ROUTES: list[tuple[str, type[msgspec.Struct]]] = [
    ("/health", api.Health), ("/v1/models", api.ModelInfoList), ("/admin/engines", api.EngineList),
    ("/admin/leases", api.LeaseList), ("/admin/timeline", api.TimelineView),
]


def fetch(tmp_path: Path, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """GET `path` from a supervisor app that knows one model (never started) and one finished request."""
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    registry = Registry({}, models_dir=tmp_path / "models", hf_cache=tmp_path / "hf")
    pool = Pool(tmp_path, config=PoolConfig(spare_engine=False))

    async def get() -> tuple[int, str, bytes]:
        app = make_app(Config(), registry, pool)
        registry.refresh()
        pool.slot_for(registry.resolve("m"))  # a row for /admin/engines
        now = time.time()
        app[TIMELINE].record("m", end=now, completion_tokens=3, decode_s=1.0, ttft_at=now - 1, ttft_ms=12.5)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get(path, headers=headers)
            return resp.status, resp.headers["Content-Type"], await resp.read()

    return asyncio.run(get())


def documented_shapes(path: str) -> list[dict[str, Any]]:
    """The schemas the document gives a GET route's JSON answer (more than one: `anyOf`)."""
    schema = make_openapi()["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    return list(schema.get("anyOf", [schema]))


def assert_answer_is(kind: type[msgspec.Struct], body: bytes) -> None:
    """`body` is `kind` encoded: every field there with its type, in its order, and no other."""
    decoded = msgspec.json.decode(body, type=kind)
    raw: dict[str, Any] = json.loads(body)
    assert msgspec.to_builtins(decoded) == raw
    assert list(raw) == list(kind.__struct_fields__)


@pytest.mark.parametrize(("path", "kind"), ROUTES)
def test_a_routes_answer_is_the_struct_its_document_names(tmp_path: Path, path: str, kind: type[msgspec.Struct]) -> None:
    shapes = documented_shapes(path)
    assert shapes[0] == {"$ref": f"#/components/schemas/{kind.__name__}"}  # the first: the plain caller's
    status, content_type, body = fetch(tmp_path, path)
    assert (status, content_type) == (200, "application/json; charset=utf-8")
    assert_answer_is(kind, body)


def test_the_answers_carry_the_rows_they_describe(tmp_path: Path) -> None:
    engines = msgspec.json.decode(fetch(tmp_path, "/admin/engines")[2], type=api.EngineList)
    assert [(row.model, row.state, row.pid, row.lease) for row in engines.data] == [("m", "stopped", None, None)]
    assert engines.spare == api.Spare(None, False)
    models = msgspec.json.decode(fetch(tmp_path / "b", "/v1/models")[2], type=api.ModelInfoList)
    assert [(m.id, m.source, m.loaded, m.load) for m in models.data] == [("m", "models_dir", False, None)]
    # No generation_config.json: a request that sets no sampling gets mlxd's, and both lists say so.
    assert models.data[0].sampling == engines.data[0].sampling == sampling.MLXD_DEFAULTS
    timeline = msgspec.json.decode(fetch(tmp_path / "c", "/admin/timeline")[2], type=api.TimelineView)
    assert sum(timeline.models["m"].completion_tokens) == pytest.approx(3, abs=0.01)


def test_the_anthropic_model_list_is_its_struct(tmp_path: Path) -> None:
    status, _, body = fetch(tmp_path, "/v1/models", {"anthropic-version": "2023-06-01"})
    assert status == 200
    assert_answer_is(anthropic.ModelCardList, body)
    assert documented_shapes("/v1/models")[1:] == [{"$ref": "#/components/schemas/ModelCardList"}]
    assert [card["id"] for card in json.loads(body)["data"]] == ["m"]


def test_a_model_drain_is_the_engines_report_after_its_model() -> None:
    assert api.ModelDrain.__struct_fields__ == ("model", *DrainResult.__struct_fields__)
    assert api.ModelDrain.__struct_defaults__ == DrainResult.__struct_defaults__
    report = DrainResult(drained=True, finished=2, cancelled=0, waited_ms=1.5, cache_written_bytes=0, resumed=True)
    drain = api.model_drain("m", report)
    assert msgspec.to_builtins(drain) == {"model": "m", **msgspec.to_builtins(report)}


@pytest.mark.parametrize("value", ['"high"', "1.5", "2147483648"])
def test_the_supervisor_refuses_a_bad_priority_naming_it(value: str) -> None:
    """The pool's queue reads `priority` from OpenAI bodies, so a bad one is a 400 before queueing."""
    from mlxd.protocol.errors import APIError
    from mlxd.supervisor.http.openai_routes import routing_fields

    with pytest.raises(APIError) as info:
        routing_fields(f'{{"model": "m", "priority": {value}}}'.encode())
    assert (info.value.status, info.value.param) == (400, "priority")
    assert routing_fields(b'{"model": "m", "priority": -3}').priority == -3
    assert routing_fields(b'{"model": "m"}').priority is None
