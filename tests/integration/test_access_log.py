"""One log line per request, with what the generation cost; the same figures on /admin/timeline."""

from __future__ import annotations

import json
import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from mlxd.protocol.process import USAGE_COMMENT, USAGE_HEADER, RequestUsage
from mlxd.supervisor.http.access import access_line, decode_speed
from tests.support import NO_EOS, SupervisorProcess, serving, wait_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 24,
        "logit_bias": NO_EOS}  # all 24 tokens: the random model never ends on its own


@pytest.fixture
def supervisor(tiny_model: Path, tmp_path: Path) -> Iterator[SupervisorProcess]:
    with serving(tiny_model, "tiny", tmp_path / "data") as sup:
        yield sup


def access_lines(sup: SupervisorProcess) -> list[str]:
    return [line.split("mlxd.access: ", 1)[1] for line in sup.log().splitlines() if "mlxd.access: " in line]


def test_a_streamed_answer_reports_its_tokens_and_speed(supervisor: SupervisorProcess) -> None:
    raw = supervisor.client.post("/v1/chat/completions", json={**CHAT, "stream": True}).content
    comments = [line for line in raw.split(b"\n") if line.startswith(USAGE_COMMENT)]
    assert len(comments) == 1 and raw.rstrip().endswith(b"data: [DONE]")
    usage = msgspec.json.decode(comments[0][len(USAGE_COMMENT):], type=RequestUsage)
    assert usage.completion_tokens == 24 and usage.prompt_tokens > 0 and usage.finish_reason == "length"
    assert wait_for(lambda: len(access_lines(supervisor)) == 1)
    line = access_lines(supervisor)[0]
    assert re.fullmatch(rf"POST /v1/chat/completions 200 tiny in={usage.prompt_tokens} cached=0 out=24 "
                        r"ttft=\d+ms [\d.]+tok/s finish=length \d+(ms|\.\d\ds)", line), line


def test_a_whole_answer_and_the_other_apis_report_too(supervisor: SupervisorProcess) -> None:
    whole = supervisor.client.post("/v1/chat/completions", json=CHAT)
    assert whole.status_code == 200 and USAGE_HEADER not in whole.headers  # the engine's header stays inside
    out = whole.json()["usage"]["completion_tokens"]
    supervisor.client.post("/v1/chat/completions", json=CHAT)  # the same prompt: from the prompt cache
    message = supervisor.anthropic().messages.create(model="tiny", max_tokens=8,
                                                     messages=[{"role": "user", "content": "hi"}])
    assert wait_for(lambda: len(access_lines(supervisor)) == 3)
    first, cached, anthropic_line = access_lines(supervisor)
    assert f" out={out} " in first and " cached=0 " in first
    assert re.search(r" cached=[1-9]\d* ", cached), cached
    assert anthropic_line.startswith("POST /v1/messages 200 tiny ") and f" out={message.usage.output_tokens} " in anthropic_line


def test_errors_are_logged_and_polls_are_not(supervisor: SupervisorProcess) -> None:
    assert supervisor.client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}).status_code == 404
    assert supervisor.client.get("/admin/engines").status_code == 200
    assert supervisor.client.post("/v1/chat/completions", content=b"{").status_code == 400
    assert wait_for(lambda: len(access_lines(supervisor)) == 2)
    assert [line.rsplit(" ", 1)[0] for line in access_lines(supervisor)] == [
        "POST /v1/chat/completions 404", "POST /v1/chat/completions 400"]


def raw_stream(sup: SupervisorProcess, body: dict[str, object], until: bytes) -> None:
    """Stream `body` over a bare socket, read until `until` arrives, then reset the connection
    (SO_LINGER 0: a client that exits, or drops a pooled connection, closes so)."""
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", sup.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        got = b""
        while until not in got:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_a_caller_that_closes_right_after_done_was_answered_and_one_that_left_was_not(
        supervisor: SupervisorProcess) -> None:
    """The reset reaches the supervisor while the handler still winds the stream down (it may be
    cancelled then): it is logged as answered (200), not as a caller that went away (499). One
    that leaves after the first event is a 499."""
    rounds = 40
    for _ in range(rounds):
        raw_stream(supervisor, {**CHAT, "max_tokens": 8}, b"data: [DONE]")
    raw_stream(supervisor, {**CHAT, "max_tokens": 2000}, b"data: {")
    assert wait_for(lambda: len(access_lines(supervisor)) == rounds + 1, timeout=30)
    statuses = [line.split(" ")[2] for line in access_lines(supervisor)]
    assert statuses == ["200"] * rounds + ["499"], statuses
    metrics = supervisor.client.get("/metrics").text
    assert f'route="/v1/chat/completions",status="200"}} {rounds}.0' in metrics
    assert 'route="/v1/chat/completions",status="499"} 1.0' in metrics


def test_the_timeline_counts_each_token_once(supervisor: SupervisorProcess) -> None:
    for _ in range(2):
        supervisor.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    view = supervisor.client.get("/admin/timeline").json()
    series = view["models"]["tiny"]
    assert view["buckets"] == len(series["completion_tokens"]) == len(series["requests"]) == len(series["ttft_ms"])
    assert sum(series["requests"]) == 2
    assert sum(series["completion_tokens"]) == pytest.approx(48, abs=0.1)
    assert any(v is not None and v > 0 for v in series["ttft_ms"])


def test_the_line_reads_well() -> None:
    usage = RequestUsage(812, 800, 64, 1.0, 90.0, 1500.0, "stop")
    record = {"method": "POST", "path": "/v1/chat/completions", "status": 200, "model": "qwen",
              "prompt_tokens": 812, "cached_tokens": 800, "completion_tokens": 64, "ttft_ms": 95.2,
              "tokens_per_s": decode_speed(usage), "duration_ms": 1620.0, "finish_reason": "stop"}
    assert access_line(record) == "POST /v1/chat/completions 200 qwen in=812 cached=800 out=64 ttft=95ms 42.0tok/s 1.62s"
    assert decode_speed(RequestUsage(5, 0, 1, 0.0, 5.0, 0.0, "length")) is None  # one token: no decode speed


def test_a_reply_gone_on_after_a_crash_says_so_and_its_speed_is_the_last_engines() -> None:
    usage = RequestUsage(812, 800, 400, 1.0, 90.0, 1000.0, "length", resumed=231)
    assert decode_speed(usage) == 168.0  # the 169 tokens the last engine made, over its decode time
    record = {"method": "POST", "path": "/v1/completions", "status": 200, "model": "tiny", "prompt_tokens": 812,
              "cached_tokens": 800, "completion_tokens": 400, "ttft_ms": 8.0, "tokens_per_s": decode_speed(usage),
              "duration_ms": 2740.0, "finish_reason": "length", "resumes": {"count": 3, "added_ms": [2122.0, 980.4], "gave_up": False}}
    assert access_line(record) == ("POST /v1/completions 200 tiny in=812 cached=800 out=400 ttft=8ms 168.0tok/s "
                                   "resumed=3(+2122ms+980ms) finish=length 2.74s")
    assert "gave-up" in access_line({**record, "resumes": {"count": 0, "added_ms": [], "gave_up": True}})
