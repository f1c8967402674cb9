"""Speculative decoding in a real engine on SmolLM2 (`--draft ngram`, mlxd/engine/spec/).

Each drafted answer is compared with the same request sent with `"speculation": false`, which
the same engine decodes without drafts: greedy answers must be the same text, token for
token, with stop strings, logprobs, a JSON schema and tool calls. The prompt asks for a small
edit of a code snippet, so the reply copies most of it and the n-gram drafter has work.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.integration.test_resume_engine import chat_text, cut_and_continue, events, marked_stream
from tests.support import (
    EngineProcess,
    engine_client,
    engine_env,
    lanes,
    openai_client,
    running_engine,
    wait_for,
)

SNIPPET = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
EDIT = f"```python\n{SNIPPET}```\n\nRewrite this code with the function `area` renamed to `surface`. Output the complete code."
MAX_TOKENS = 28


@pytest.fixture(scope="module")
def smol(smollm2: Path) -> Iterator[EngineProcess]:
    """Four batch rows (a drafting row can be handed to the batch lane), drafts from the context;
    rows that end a few steps apart linger in the batch as on a GPU (gpu/linger.py: the rows
    of spec_drafters' tests leave as they end, as on a CPU)."""
    with running_engine(smollm2, "smol", "--draft", "ngram", "--batch", "4", "--kv-budget-tokens", "4096",
                        env=engine_env(MLXD_LINGER_ROWS="1")) as e:
        yield e


def chat(engine: EngineProcess, drafts: bool, **body: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": EDIT}], "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    if not drafts:
        body["speculation"] = False
    with engine_client(engine) as c:
        resp = c.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())


def both(engine: EngineProcess, **body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same request without drafts, then with them."""
    return chat(engine, False, **body), chat(engine, True, **body)


def message(answer: dict[str, Any]) -> dict[str, Any]:
    return dict(answer["choices"][0]["message"])


def test_drafted_greedy_answers_are_the_undrafted_ones_and_say_what_was_drafted(smol: EngineProcess) -> None:
    with openai_client(smol) as client:
        plain = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": EDIT}],
                                               max_tokens=MAX_TOKENS, temperature=0, extra_body={"speculation": False})
        drafted = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": EDIT}],
                                                 max_tokens=MAX_TOKENS, temperature=0)
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert "return width * height" in (drafted.choices[0].message.content or "")  # it copied the code
    assert drafted.usage is not None and plain.usage is not None
    assert drafted.usage.completion_tokens == plain.usage.completion_tokens == MAX_TOKENS
    spec = (drafted.usage.model_extra or {})["speculation"]
    assert 0 < spec["accepted"] <= spec["proposed"], spec
    assert spec["accepted"] < MAX_TOKENS  # every pass emits a token of the target's own besides the drafts it kept
    assert "speculation" not in (plain.usage.model_extra or {})  # opted out: decoded without drafts
    stats = lanes(smol)
    assert stats["draft"] == "ngram" and stats["draft_accepted"] >= spec["accepted"]


@pytest.mark.slow  # about 8 s: `make test` stays under 10 minutes (the batch test keeps a stop string)
def test_a_stop_string_inside_kept_drafts_ends_the_answer_where_it_would(smol: EngineProcess) -> None:
    full = message(chat(smol, False))["content"]
    stop = "perimeter("  # in the copied code, after the renamed function
    assert stop in full
    plain, drafted = both(smol, stop=[stop])
    assert message(drafted)["content"] == message(plain)["content"] == full[:full.index(stop)]
    assert drafted["choices"][0]["finish_reason"] == "stop"
    assert drafted["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_logprobs_are_those_of_each_emitted_token(smol: EngineProcess) -> None:
    plain, drafted = both(smol, logprobs=True, top_logprobs=2, max_tokens=16)
    a, b = plain["choices"][0]["logprobs"]["content"], drafted["choices"][0]["logprobs"]["content"]
    assert [x["token"] for x in a] == [x["token"] for x in b] and len(a) == 16
    for x, y in zip(a, b, strict=True):
        assert y["logprob"] == pytest.approx(x["logprob"], abs=2e-3)
        assert [t["token"] for t in y["top_logprobs"]] == [t["token"] for t in x["top_logprobs"]]
    assert drafted["usage"]["speculation"]["accepted"] > 0


@pytest.mark.slow  # about 9 s on 2 cores: `make test` stays under 10 minutes
def test_a_json_schema_held_answer_drafts_and_is_the_same(smol: EngineProcess) -> None:
    schema = {"type": "object", "properties": {"function_name": {"type": "string"}, "renamed_to": {"type": "string"},
                                               "line_count": {"type": "integer"}},
              "required": ["function_name", "renamed_to", "line_count"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "edit", "schema": schema, "strict": True}}
    plain, drafted = both(smol, response_format=fmt, max_tokens=60)
    assert message(drafted)["content"] == message(plain)["content"]
    parsed = json.loads(message(drafted)["content"])
    assert set(parsed) == {"function_name", "renamed_to", "line_count"}
    spec = drafted["usage"]["speculation"]
    assert spec["accepted"] > 0, spec  # the keys the schema forces are drafts the grammar vouches for


@pytest.mark.slow  # about 5 s: `make test` stays under 10 minutes
def test_a_tool_call_is_the_same_with_drafts(smol: EngineProcess) -> None:
    tool = {"type": "function", "function": {
        "name": "rename", "description": "Rename a function in the code.",
        "parameters": {"type": "object", "properties": {"old": {"type": "string"}, "new": {"type": "string"}},
                       "required": ["old", "new"]}}}
    plain, drafted = both(smol, tools=[tool], tool_choice={"type": "function", "function": {"name": "rename"}},
                          max_tokens=48)
    a, b = message(plain)["tool_calls"], message(drafted)["tool_calls"]
    assert [c["function"] for c in b] == [c["function"] for c in a]
    assert b[0]["function"]["name"] == "rename"


@pytest.mark.slow  # about 6 s: `make test` stays under 10 minutes
def test_a_streamed_answer_is_the_same_and_ends_with_what_was_drafted(smol: EngineProcess) -> None:
    with openai_client(smol) as client:
        def stream(extra: dict[str, Any]) -> tuple[str, Any]:
            parts, usage = [], None
            for chunk in client.chat.completions.create(
                    model="smol", messages=[{"role": "user", "content": EDIT}], max_tokens=MAX_TOKENS, temperature=0,
                    stream=True, stream_options={"include_usage": True}, extra_body=extra):
                parts += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            return "".join(parts), usage

        plain_text, _ = stream({"speculation": False})
        text, usage = stream({})
    assert text == plain_text
    assert usage is not None and usage.model_extra["speculation"]["accepted"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 9])
def test_drafts_never_run_past_max_tokens(smol: EngineProcess, max_tokens: int) -> None:
    plain, drafted = both(smol, max_tokens=max_tokens)
    assert drafted["usage"]["completion_tokens"] == max_tokens
    assert message(drafted)["content"] == message(plain)["content"]
    wait_for(lambda: lanes(smol)["kv_booked_tokens"] == 0, 10, message=lambda: str(lanes(smol)))  # released after the answer


@pytest.mark.slow  # about 15 s with its engine: `make test` stays under 10 minutes (test_spec.py pins the draws, fast)
def test_a_seeded_answer_is_the_same_with_drafts_without_them_and_after_a_resume(smollm2: Path) -> None:
    """A seeded row checks its drafts with the keys of their places in the reply: its answer is
    the one decoded without drafts, and the reply cut mid-way and continued (docs/resume.md)
    draws the same tokens after the cut. An engine of its own: the module's has timed its
    earlier rows, and on their word a new row may start without drafts (1 run in 10 did)."""
    body = {"messages": [{"role": "user", "content": EDIT}], "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 11, "stream_options": {"include_usage": True}}
    with running_engine(smollm2, "smol", "--draft", "ngram") as fresh:
        _, plain = marked_stream(fresh, "/v1/chat/completions", {**body, "speculation": False})
        want = chat_text(events(b"".join(p for p, _ in plain)))
        drafted = marked_stream(fresh, "/v1/chat/completions", body)
        chunks = events(b"".join(p for p, _ in drafted[1]))
        assert chat_text(chunks) == want
        assert chunks[-1]["usage"]["speculation"]["accepted"] > 0, chunks[-1]["usage"]
        before, after = cut_and_continue(fresh, "/v1/chat/completions", body, (len(drafted[1]) - 1) // 2, drafted)
        assert chat_text(events(before)) + chat_text(events(after)) == want
        assert message(chat(fresh, True, temperature=1.0, seed=12))["content"] != want  # the seed decides the draws


@pytest.mark.slow  # about 10 s: `make test` stays under 10 minutes (test_spec_decoder.py checks `release` fast)
def test_a_drafting_row_handed_to_the_batch_lane_goes_on_as_it_would_alone(smol: EngineProcess) -> None:
    """A second request arriving moves the lone drafting row into the batch lane, mid-answer;
    both answers are what each gets decoded alone without drafts."""
    long_ask = {"max_tokens": 40}
    other = {"messages": [{"role": "user", "content": "List three colours."}], "max_tokens": 16}
    alone = message(chat(smol, False, **long_ask))["content"]
    other_alone = message(chat(smol, False, **other))["content"]
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(smol.socket)), base_url="http://engine",
                      timeout=120) as c, c.stream("POST", "/v1/chat/completions", json={
                          "messages": [{"role": "user", "content": EDIT}], "temperature": 0, "stream": True,
                          **long_ask}) as resp:
        lines = resp.iter_lines()
        parts = []
        for line in lines:  # until it has decoded some of its answer in the serial lane
            if line.startswith("data: {") and (delta := json.loads(line[6:])["choices"][0]["delta"].get("content")):
                parts.append(delta)
                if len(parts) >= 8:
                    break
        assert lanes(smol)["serial"] == 1
        second = chat(smol, True, **other)
        for line in lines:
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                parts += [c["delta"].get("content") or "" for c in choices]
    assert "".join(parts) == alone
    assert message(second)["content"] == other_alone


def test_a_client_leaving_mid_answer_leaves_the_engine_serving(smol: EngineProcess) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(smol.socket)), base_url="http://engine",
                      timeout=120) as c, c.stream("POST", "/v1/chat/completions", json={
                          "messages": [{"role": "user", "content": EDIT}], "temperature": 0, "stream": True,
                          "max_tokens": 200}) as resp:
        for n, _line in enumerate(resp.iter_lines()):
            if n > 6:
                break
    wait_for(lambda: lanes(smol)["serial"] + lanes(smol)["batch"] == 0, 30, message=lambda: str(lanes(smol)))
    plain, drafted = both(smol, max_tokens=12)
    assert message(drafted)["content"] == message(plain)["content"]


def test_a_speculation_field_that_is_not_a_boolean_is_a_400(smol: EngineProcess) -> None:
    with engine_client(smol) as c:
        resp = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "speculation": "off"})
    assert resp.status_code == 400
    assert "speculation" in resp.json()["error"]["message"] + str(resp.json()["error"].get("param"))


def test_rows_decoding_together_draft_in_the_batch_and_answer_as_alone(smol: EngineProcess) -> None:
    """Four requests at once decode in the batch lane: two draft (one held to a stop string),
    one opted out, one with logprobs. Each answer is what it gets alone without drafts, and
    the drafting rows kept drafts there; the rows that ended first lingered for the others."""
    asks = [{"max_tokens": 40}, {"max_tokens": 40, "stop": ["perimeter("]}, {"max_tokens": 16, "speculation": False},
            {"max_tokens": 20, "logprobs": True}]
    alone = [chat(smol, False, **{k: v for k, v in a.items() if k != "speculation"}) for a in asks]
    lingered = lanes(smol)["rows_lingered"]
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: chat(smol, True, **a), asks))
    assert [message(t)["content"] for t in together] == [message(a)["content"] for a in alone]
    assert lanes(smol)["rows_lingered"] > lingered, lanes(smol)
    for answer in (together[0], together[1], together[3]):
        assert answer["usage"]["speculation"]["accepted"] > 0, answer["usage"]
    assert "speculation" not in together[2]["usage"]
    got, want = together[3]["choices"][0]["logprobs"]["content"], alone[3]["choices"][0]["logprobs"]["content"]
    assert [x["token"] for x in got] == [x["token"] for x in want]
    assert [x["logprob"] for x in got] == pytest.approx([x["logprob"] for x in want], abs=2e-3)
    wait_for(lambda: lanes(smol)["kv_booked_tokens"] == 0, 10, message=lambda: str(lanes(smol)))  # released after the answer
    assert lanes(smol)["draft_batch_passes"] > 0


@pytest.mark.slow  # about 15 s on 2 cores: `make test` stays under 10 minutes
def test_rows_held_to_a_json_schema_draft_in_the_batch_and_answer_as_alone(smol: EngineProcess) -> None:
    """Two rows under a JSON schema and one free row decode together: each answer is what it
    gets alone without drafts; the held rows kept drafts (the keys their schema forces)."""
    schema = {"type": "object", "properties": {"old_name": {"type": "string"}, "new_name": {"type": "string"},
                                               "changed_lines": {"type": "integer"}},
              "required": ["old_name", "new_name", "changed_lines"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "edit", "schema": schema, "strict": True}}
    asks = [{"max_tokens": 48, "response_format": fmt}, {"max_tokens": 40},
            {"max_tokens": 48, "response_format": fmt, "stop": ["}"]}]
    alone = [chat(smol, False, **a) for a in asks]
    before = lanes(smol)
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: chat(smol, True, **a), asks))
    assert [message(t)["content"] for t in together] == [message(a)["content"] for a in alone]
    assert set(json.loads(message(together[0])["content"])) == {"old_name", "new_name", "changed_lines"}
    for answer in together:
        assert answer["usage"]["speculation"]["accepted"] > 0, answer["usage"]
    assert lanes(smol)["draft_batch_passes"] > before["draft_batch_passes"], lanes(smol)  # they met in the batch


@pytest.mark.slow  # about 11 s: `make test` stays under 10 minutes (CI runs the slow ones too)
def test_a_row_leaving_the_batch_mid_answer_leaves_the_others_as_alone(smol: EngineProcess) -> None:
    """Three rows draft together; one client goes after a few tokens. Its row leaves the batch's
    KV (holes and all, spec/holes.py) and the other two answer as they do alone."""
    asks = [{"max_tokens": 40}, {"max_tokens": 36, "stop": ["perimeter("]}]
    alone = [chat(smol, False, **a) for a in asks]
    before = lanes(smol)["draft_batch_passes"]

    def leaving() -> int:
        with engine_client(smol) as c, c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": EDIT}], "temperature": 0, "stream": True,
                "max_tokens": 200}) as resp:
            for n, _line in enumerate(resp.iter_lines()):
                if n > 12:
                    return n
        return -1

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        gone = pool.submit(leaving)
        together = list(pool.map(lambda a: chat(smol, True, **a), asks))
    assert gone.result() > 0
    assert [message(t)["content"] for t in together] == [message(a)["content"] for a in alone]
    assert lanes(smol)["draft_batch_passes"] > before, lanes(smol)
    wait_for(lambda: lanes(smol)["serial"] + lanes(smol)["batch"] == 0 and lanes(smol)["kv_booked_tokens"] == 0, 30,
             message=lambda: str(lanes(smol)))


@pytest.mark.slow  # a fresh engine, about 15 s: `make test` stays under 10 minutes
def test_drafting_rows_stay_within_the_kv_budget(smollm2: Path) -> None:
    """A KV budget that holds two of the four requests at once: the others wait, what is booked
    never passes the budget while rows draft, and every answer is the one it gets alone."""
    with running_engine(smollm2, "smol", "--draft", "ngram", "--batch", "4", "--kv-budget-tokens", "400") as engine:
        alone = chat(engine, False, max_tokens=40)
        need = alone["usage"]["prompt_tokens"] + 40
        assert 2 * need <= 400 < 3 * need, need  # two rows fit, not three
        seen: list[int] = []
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            answers = [pool.submit(chat, engine, True, max_tokens=40) for _ in range(4)]
            while not all(a.done() for a in answers):
                seen.append(lanes(engine)["kv_booked_tokens"])
            together = [a.result() for a in answers]
        assert max(seen) <= 400 and max(seen) >= need, seen
        assert all(message(t)["content"] == message(alone)["content"] for t in together)
        assert sum(t["usage"]["speculation"]["accepted"] for t in together) > 0
