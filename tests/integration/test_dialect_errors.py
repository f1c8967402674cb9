"""Every error reaches the caller in its own API, whichever path it takes: a stream that waited
(its SSE head and comments out) and then failed ends with its dialect's error events."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support import SupervisorProcess, fake_supervisor


@pytest.fixture(scope="module")
def sup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    config = "[server]\nstream_keepalive_s = 0.2\n\n[pool]\nqueue_timeout_s = 1\n"
    proc = fake_supervisor(tmp_path_factory.mktemp("dialects"), config=config)
    lease = proc.client.post("/admin/leases", json={"model": None, "ttl_s": 600})  # every request waits
    assert lease.status_code == 200, lease.text
    try:
        yield proc
    finally:
        proc.stop()


def waited_stream(sup: SupervisorProcess, path: str, body: dict[str, object]) -> list[str]:
    """A stream's lines, once it has waited out the queue."""
    with sup.client.stream("POST", path, json=body, headers={"anthropic-version": "2023-06-01"}) as resp:
        assert resp.status_code == 200  # the head went out with the first waiting comment
        lines = [line for line in resp.iter_lines() if line]
    assert lines[0].startswith(": waiting"), lines
    return lines


def events(lines: list[str]) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_waited_chat_stream_ends_with_openais_error_event(sup: SupervisorProcess) -> None:
    lines = waited_stream(sup, "/v1/chat/completions",
                          {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    [event] = events(lines)
    assert event["error"]["code"] == "queue_timeout"  # type: ignore[index]


def test_a_waited_responses_stream_ends_with_error_and_response_failed(sup: SupervisorProcess) -> None:
    lines = waited_stream(sup, "/v1/responses", {"model": "fake", "stream": True, "input": "hi"})
    got = events(lines)
    kinds = [e["type"] for e in got]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"], kinds
    assert [e["sequence_number"] for e in got] == [0, 1, 2, 3]
    assert got[2]["code"] == "queue_timeout"
    failed = got[3]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "queue_timeout"  # type: ignore[index]
    assert lines[-1] == "data: [DONE]"
    assert not any("\"error\": {\"message\"" in line for line in lines)  # no chat-shaped error event


def test_a_waited_anthropic_stream_ends_with_its_error_event(sup: SupervisorProcess) -> None:
    lines = waited_stream(sup, "/v1/messages", {"model": "fake", "stream": True, "max_tokens": 5,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert "event: error" in lines
    [event] = events(lines)
    assert event["type"] == "error" and event["error"]["type"] in ("api_error", "overloaded_error")  # type: ignore[index]


def test_a_waited_ollama_stream_has_no_comments_and_ends_with_an_error_line(sup: SupervisorProcess) -> None:
    """NDJSON has no comments: the head goes out while it waits, then nothing but JSON lines."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}  # Ollama streams by default
    with sup.client.stream("POST", "/api/chat", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
        lines = [line for line in resp.iter_lines() if line]
    assert len(lines) == 1, lines
    assert set(json.loads(lines[0])) == {"error"} and "wait" in json.loads(lines[0])["error"].lower()
