"""Responses over a WebSocket (OpenAI's WebSocket mode) and `POST /v1/responses/compact`,
through a real supervisor and engine (the tiny model), with the official `openai` SDK's
`responses.connect()` and raw sockets for what the SDK would never send: a chain over the
socket, stored and unstored; bad messages answered with error events on an open socket; a
client gone mid-turn; compaction items summarizing a chain and read back as input."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from websockets.sync.client import connect

from tests.support import NO_EOS, SupervisorProcess


@pytest.fixture(scope="module")
def sup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    proc = SupervisorProcess(f'[models.tiny]\npath = "{tiny_model}"\n',
                             tmp_path_factory.mktemp("ws") / "data").wait_up()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(sup: SupervisorProcess) -> openai.OpenAI:
    return sup.openai()


ENDED = ("response.completed", "response.incomplete")  # 8 tokens: a reply usually ends incomplete


def ws_url(sup: SupervisorProcess) -> str:
    return sup.url.replace("http://", "ws://") + "/v1/responses"


def turn(ws: Any, **body: Any) -> list[dict[str, Any]]:
    """Send one response.create; the events until the turn ends (completed, failed or an error)."""
    ws.send(json.dumps({"type": "response.create", "model": "tiny", "max_output_tokens": 8,
                        "temperature": 0, **body}))
    events = []
    while True:
        event = json.loads(ws.recv(timeout=60))
        events.append(event)
        if event["type"] in (*ENDED, "response.failed", "error"):
            return events


# The SDK opens its websockets connection without a context manager, which websockets 17.1+ warns about.
@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")
def test_the_sdk_runs_turns_over_one_socket_and_chains_them(client: openai.OpenAI) -> None:
    with client.responses.connect() as conn:
        conn.send({"type": "response.create", "model": "tiny", "input": "Hello", "max_output_tokens": 8,
                   "temperature": 0})  # type: ignore[arg-type]
        kinds, first = [], None
        for event in conn:
            kinds.append(event.type)
            if event.type in ENDED:
                first = event.response  # type: ignore[attr-defined]
                break
        assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
        assert first is not None and first.output_text
        conn.send({"type": "response.create", "model": "tiny", "input": "And then?", "max_output_tokens": 8,
                   "temperature": 0, "previous_response_id": first.id})  # type: ignore[arg-type]
        second = next(e.response for e in conn if e.type in ENDED)  # type: ignore[attr-defined]
    stored = client.responses.retrieve(second.id)  # stored, as a POSTed turn is
    assert stored.output_text == second.output_text
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"]  # its own input; the first turn is its chain


def test_a_socket_turn_is_the_posted_one(sup: SupervisorProcess, client: openai.OpenAI) -> None:
    body = {"input": "Say something", "extra_body": None}
    posted = client.responses.create(model="tiny", input=body["input"], max_output_tokens=8, temperature=0)
    with connect(ws_url(sup)) as ws:
        events = turn(ws, input=body["input"])
    assert events[-1]["type"] in ENDED
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == posted.output_text


def test_unstored_turns_chain_within_the_socket_only(sup: SupervisorProcess, client: openai.OpenAI) -> None:
    with connect(ws_url(sup)) as ws:
        first = turn(ws, input="Hello", store=False)[-1]["response"]
        second = turn(ws, input="More", store=False, previous_response_id=first["id"])[-1]
        assert second["type"] in ENDED
        tokens = second["response"]["usage"]["input_tokens"]
        alone = turn(ws, input="More", store=False)[-1]["response"]["usage"]["input_tokens"]
        assert tokens > alone  # the first turn's input and output went along
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first["id"])
    with connect(ws_url(sup)) as ws:  # another socket does not know it
        err = turn(ws, input="More", previous_response_id=first["id"])[-1]
        assert err["type"] == "error" and err["status"] == 404
        assert err["error"]["code"] == "previous_response_not_found"


@pytest.mark.parametrize(("message", "code"), [
    ("not json", "invalid_json"),
    (json.dumps({"type": "session.update"}), "unknown_event_type"),
    (json.dumps([1, 2]), "unknown_event_type"),
    (json.dumps({"type": "response.create", "model": "tiny", "input": "x", "background": True}),
     "unsupported_parameter"),
    (json.dumps({"type": "response.create", "model": "nope", "input": "x"}), "model_not_found"),
    (json.dumps({"type": "response.create", "model": "tiny", "input": 5}), None),
])
def test_bad_messages_get_an_error_event_and_the_socket_stays_open(sup: SupervisorProcess, message: str,
                                                                    code: str | None) -> None:
    with connect(ws_url(sup)) as ws:
        ws.send(message)
        err = json.loads(ws.recv(timeout=30))
        assert err["type"] == "error" and 400 <= err["status"] < 500 and err["error"]["message"]
        if code is not None:
            assert err["error"]["code"] == code
        assert turn(ws, input="still here")[-1]["type"] in ENDED


def test_a_plain_get_is_a_405_and_keys_guard_the_socket(sup: SupervisorProcess) -> None:
    resp = sup.client.get("/v1/responses")
    assert resp.status_code == 405 and "WebSocket" in resp.json()["error"]["message"]


def in_flight(sup: SupervisorProcess) -> int:
    return sum(e["in_flight"] for e in sup.client.get("/admin/engines").json()["data"])


def test_turns_sent_at_once_run_one_after_another_in_order(sup: SupervisorProcess) -> None:
    """The socket is read while a turn runs; what comes meanwhile waits its turn."""
    with connect(ws_url(sup)) as ws:
        for text in ("first", "second", "not json"):
            ws.send(json.dumps({"type": "response.create", "model": "tiny", "input": text, "max_output_tokens": 6,
                                "temperature": 0, "metadata": {"n": text}}) if text != "not json" else text)
        seen: list[tuple[str, str | None]] = []
        while len(seen) < 5:
            event = json.loads(ws.recv(timeout=60))
            if event["type"] in ("response.created", *ENDED):
                seen.append((event["type"], event["response"]["metadata"]["n"]))
            elif event["type"] == "error":
                seen.append(("error", event["error"]["code"]))
    assert [n for _, n in seen] == ["first", "first", "second", "second", "invalid_json"]
    assert seen[0][0] == seen[2][0] == "response.created"


def test_a_client_gone_mid_turn_stops_the_engine(sup: SupervisorProcess) -> None:
    with connect(ws_url(sup), close_timeout=5) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "tiny", "input": "go on",
                            "max_output_tokens": 4000, "temperature": 0}))
        assert json.loads(ws.recv(timeout=30))["type"] == "response.created"
        assert in_flight(sup) == 1
        closing = time.monotonic()
    # The server read the close mid-turn and answered it (it does not wait for the turn to end)
    assert ws.protocol.close_rcvd is not None and time.monotonic() - closing < 3
    # 4000 tokens take this CPU 6 s or more (the tiny model's greedy text runs to the limit); a turn
    # whose socket closed ends at once
    deadline = time.monotonic() + 2.5
    while in_flight(sup) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert in_flight(sup) == 0, "the turn kept running after its socket closed"


def test_compaction_summarizes_a_chain_and_its_item_is_read_back(client: openai.OpenAI) -> None:
    # Greedy turns: the summary (greedy too, up to 2048 tokens) is then the same every run. With
    # sampled turns, the random model's summary came back once as 4,267 tokens of text, past its
    # 4,096-token window in the next turn.
    first = client.responses.create(model="tiny", input="My name is Ada. Remember it.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model="tiny", input="What did I say?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    compacted = client.post("/responses/compact", cast_to=dict,  # type: ignore[type-var]
                            body={"model": "tiny", "previous_response_id": second.id})
    assert compacted["object"] == "response.compaction"
    kinds = [i["type"] for i in compacted["output"]]
    assert kinds == ["compaction", "message"]
    assert compacted["output"][1]["content"][0]["text"] == "What did I say?"  # the last user message, kept
    assert compacted["usage"]["input_tokens"] > 0
    nxt = client.responses.create(model="tiny", input=[*compacted["output"], {"role": "user", "content": "Go on"}],
                                  max_output_tokens=4, extra_body={"logit_bias": NO_EOS})
    assert nxt.status == "incomplete" and nxt.output_text  # 4 tokens, EOS kept away
    bad = {"type": "compaction", "encrypted_content": "gAAAAABo-someone-elses"}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input=[bad, {"role": "user", "content": "x"}])  # type: ignore[list-item]
    assert "compaction" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.post("/responses/compact", cast_to=dict, body={"model": "tiny", "previous_response_id": "resp_gone"})  # type: ignore[type-var]
