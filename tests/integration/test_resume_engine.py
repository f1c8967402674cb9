"""A continued reply on a real engine (`resume`, docs/resume.md): the stream's resume marks, and
a reply cut after any of them and continued on the engine giving what the uninterrupted one
gave, in text, tool calls, stop strings and usage."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxd.protocol.process import MARKS_HEADER, REPLY_HEADER
from tests.support import EngineProcess, engine_client


@pytest.fixture(scope="module")
def smol(smol_engine: EngineProcess) -> EngineProcess:
    """SmolLM2, for the tool call and the JSON schema (its chat template knows tools)."""
    return smol_engine


@pytest.fixture(scope="module")
def tiny(tiny_engine: EngineProcess) -> EngineProcess:
    """The tiny random model: greedy text that is nonsense but fast, and the same every time."""
    return tiny_engine


NO_EOS = {"2": -100}  # the tiny model's EOS, biased away


Piece = tuple[bytes, list[int]]  # one write's events, and the token ids its mark named


def marked_stream(engine: EngineProcess, path: str, body: dict[str, Any]) -> tuple[str, list[Piece]]:
    """A marked stream from the engine: its reply header, and its writes (the events before each
    mark, and the mark's ids; the last piece, with no mark, ends the stream). Each mark's total
    counts the reply's tokens, a continued reply's delivered ones included."""
    with engine_client(engine) as c, c.stream("POST", path, json={**body, "stream": True},
                                              headers={MARKS_HEADER: "1"}) as resp:
        assert resp.status_code == 200
        reply = resp.headers[REPLY_HEADER]
        raw = resp.read()
    pieces: list[Piece] = []
    rest = raw
    total = len(body["resume"].get("tokens", [])) if "resume" in body else 0
    while (at := rest.find(b": ids ")) >= 0:
        end = rest.index(b"\n\n", at)
        index, count, ids_text = rest[at + 6:end].decode().split(" ")
        ids = [int(i) for i in ids_text.split(",") if i]
        total += len(ids)
        assert (int(index), int(count)) == (0, total)
        pieces.append((rest[:at], ids))
        rest = rest[end + 2:]
    pieces.append((rest, []))
    return reply, pieces


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


def chat_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def cuts(pieces: list[Piece]) -> list[int]:
    """Three marks to cut after (the first, one in the middle, the last): how many marks a reply
    gets depends on how its tokens were batched, which a loaded machine changes."""
    return sorted({0, (len(pieces) - 1) // 2, len(pieces) - 2})


def cut_and_continue(engine: EngineProcess, path: str, body: dict[str, Any], at: int,
                     whole: tuple[str, list[Piece]] | None = None) -> tuple[bytes, bytes]:
    """The stream's bytes up to its `at`-th mark, and the continuation's, sent with those marks'
    tokens (`whole`: the uninterrupted stream, if the caller has it)."""
    reply, pieces = whole or marked_stream(engine, path, body)
    assert at < len(pieces) - 1
    rid, created = reply.split(" ")
    before = b"".join(p for p, _ in pieces[:at + 1])
    tokens = [t for _, ids in pieces[:at + 1] for t in ids]
    segments = [len(ids) for _, ids in pieces[:at + 1]]
    resume = {"tokens": tokens, "segments": segments, "id": rid, "created": int(created)}
    _, rest = marked_stream(engine, path, {**body, "resume": resume})
    return before, b"".join(p for p, _ in rest)


CHAT = {"messages": [{"role": "user", "content": "Write three sentences about the sea."}],
        "max_tokens": 48, "temperature": 0, "stream_options": {"include_usage": True}, "logit_bias": NO_EOS}


def test_marks_name_every_token_and_the_reply(tiny: EngineProcess) -> None:
    reply, pieces = marked_stream(tiny, "/v1/chat/completions", CHAT)
    chunks = events(b"".join(p for p, _ in pieces))
    assert reply.split(" ")[0] == chunks[0]["id"] and int(reply.split(" ")[1]) == chunks[0]["created"]
    usage = chunks[-1]["usage"]
    tokens = sum(len(ids) for _, ids in pieces)
    # the last write (the end, with [DONE]) needs no mark: its tokens are not named
    assert 0 < tokens <= usage["completion_tokens"] == 48
    assert len(pieces) >= 3


def test_a_chat_stream_continued_after_any_mark_is_the_uninterrupted_one(tiny: EngineProcess) -> None:
    whole = marked_stream(tiny, "/v1/chat/completions", CHAT)
    want = events(b"".join(p for p, _ in whole[1]))
    for at in range(len(whole[1]) - 1):
        before, after = cut_and_continue(tiny, "/v1/chat/completions", CHAT, at, whole)
        first, rest = events(before), events(after)
        assert chat_text(first) + chat_text(rest) == chat_text(want), at
        assert all(c["choices"][0]["delta"].get("role") is None for c in rest if c["choices"])  # no second opening
        assert {c["id"] for c in first + rest} == {want[0]["id"]}
        assert {c["created"] for c in first + rest} == {want[0]["created"]}
        usage, want_usage = rest[-1]["usage"], want[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (want_usage["prompt_tokens"], 48)
        assert rest[-2]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_held_back_at_the_cut_still_stops(tiny: EngineProcess) -> None:
    text = chat_text(events(b"".join(p for p, _ in marked_stream(tiny, "/v1/chat/completions", CHAT)[1])))
    stop = text[30:36]  # a string the reply writes: it ends there
    body = {**CHAT, "stop": [stop]}
    stopped = marked_stream(tiny, "/v1/chat/completions", body)
    want = events(b"".join(p for p, _ in stopped[1]))
    assert chat_text(want) == text[:text.index(stop)]
    for at in range(len(stopped[1]) - 1):
        before, after = cut_and_continue(tiny, "/v1/chat/completions", body, at, stopped)
        assert chat_text(events(before)) + chat_text(events(after)) == chat_text(want), at
        assert events(after)[-2]["choices"][0]["finish_reason"] == "stop"


def test_a_text_completion_continues_too(tiny: EngineProcess) -> None:
    body = {"prompt": "The history of the lighthouse", "max_tokens": 40, "temperature": 0, "logit_bias": NO_EOS}
    whole = marked_stream(tiny, "/v1/completions", body)
    want = "".join(c["choices"][0]["text"] for c in events(b"".join(p for p, _ in whole[1])))
    for at in cuts(whole[1]):
        before, after = cut_and_continue(tiny, "/v1/completions", body, at, whole)
        assert "".join(c["choices"][0]["text"] for c in events(before) + events(after)) == want


def test_a_whole_answer_with_resume_is_the_whole_reply(tiny: EngineProcess) -> None:
    with engine_client(tiny) as c:
        plain = c.post("/v1/chat/completions", json={**CHAT, "stream": False}).json()
        _, pieces = marked_stream(tiny, "/v1/chat/completions", CHAT)
        tokens = [t for _, ids in pieces[:4] for t in ids]
        cont = c.post("/v1/chat/completions", json={**CHAT, "stream": False, "resume": {"tokens": tokens}}).json()
    assert cont["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert cont["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert cont["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_resent_start_comes_first_split_as_it_went_out_then_the_rest(tiny: EngineProcess, path: str) -> None:
    body = CHAT if path == "/v1/chat/completions" else {
        "prompt": "The history of the lighthouse", "max_tokens": 40, "temperature": 0, "logit_bias": NO_EOS}
    reply, pieces = marked_stream(tiny, path, body)
    want = events(b"".join(p for p, _ in pieces))
    at = (len(pieces) - 1) // 2
    tokens = [t for _, ids in pieces[:at + 1] for t in ids]
    segments = [len(ids) for _, ids in pieces[:at + 1]]
    rid, created = reply.split(" ")
    resume = {"tokens": tokens, "segments": segments, "id": rid, "created": int(created), "resend": True}
    with engine_client(tiny) as c, c.stream("POST", path, json={**body, "stream": True, "resume": resume},
                                            headers={MARKS_HEADER: "1"}) as resp:
        raw = resp.read()
    got = events(raw)
    text = chat_text if path == "/v1/chat/completions" else (
        lambda chunks: "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]))
    assert text(got) == text(want)
    if path == "/v1/chat/completions":
        assert got[0]["choices"][0]["delta"].get("role") == "assistant"  # it opens, as a new stream does
        # the delivered part: the chunks its writes made, one for one, before any new one
        before = [c["choices"][0]["delta"].get("content") for c in want if c["choices"]][1:at + 2]
        assert [c["choices"][0]["delta"].get("content") for c in got if c["choices"]][1:at + 2] == before
    first_mark = raw[raw.index(b": ids "):].split(b"\n", 1)[0].decode().split(" ")
    assert int(first_mark[3]) >= len(tokens)  # its total counts the resent tokens
    assert [int(i) for i in first_mark[4].split(",")][:len(tokens)] == tokens


def choice_writes(raw: bytes) -> list[tuple[int, list[dict[str, Any]], list[int], bool]]:
    """An `n` > 1 marked stream's writes: each one choice's (its index, its chunks, the ids its
    mark named, whether the mark said its choice ended); the unmarked end is left out."""
    out = []
    rest = raw
    while (at := rest.find(b": ids ")) >= 0:
        end = rest.index(b"\n\n", at)
        index, _total, ids_text, *closed = rest[at + 6:end].decode().split(" ")
        out.append((int(index), events(rest[:at]), [int(i) for i in ids_text.split(",") if i], bool(closed)))
        rest = rest[end + 2:]
    return out


def choice_texts(chunks: list[dict[str, Any]], n: int) -> list[str]:
    texts = [""] * n
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
    return texts


def finishes(chunks: list[dict[str, Any]]) -> list[int]:
    return [ch["index"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]


def test_n_choices_each_go_on_from_their_own_tokens(tiny: EngineProcess) -> None:
    n = 3
    body = {**CHAT, "n": n, "temperature": 1.0, "seed": 11, "max_tokens": 24}
    with engine_client(tiny) as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                                            headers={MARKS_HEADER: "1"}) as resp:
        rid, created = resp.headers[REPLY_HEADER].split(" ")
        raw = resp.read()
    want = events(raw)
    want_texts = choice_texts(want, n)
    assert len(set(want_texts)) == n  # seeded rows draw apart
    writes = choice_writes(raw)
    assert {i for i, *_ in writes} == set(range(n))
    assert sorted(i for i, _, _, closed in writes if closed) == list(range(n))  # each choice's end is marked
    for at in (len(writes) // 3, 2 * len(writes) // 3, len(writes) - 2):
        delivered = writes[:at + 1]
        choices = [{"tokens": [t for i, _, ids, _ in delivered if i == k for t in ids],
                    "segments": [len(ids) for i, _, ids, _ in delivered if i == k],
                    "ended": any(closed for i, _, _, closed in delivered if i == k)} for k in range(n)]
        resume = {"choices": choices, "id": rid, "created": int(created)}
        with engine_client(tiny) as c, c.stream("POST", "/v1/chat/completions",
                                                json={**body, "stream": True, "resume": resume},
                                                headers={MARKS_HEADER: "1"}) as resp:
            after = events(resp.read())
        before = [chunk for _, chunks, _, _ in delivered for chunk in chunks]
        got = choice_texts(before, n)
        assert [a + b for a, b in zip(got, choice_texts(after, n), strict=True)] == want_texts, at
        assert sorted(finishes(before) + finishes(after)) == list(range(n)), at  # each choice ends once
        assert not any(ch["delta"].get("role") for c in after for ch in c["choices"])  # no second opening
        assert after[-1]["usage"]["completion_tokens"] == want[-1]["usage"]["completion_tokens"] == n * 24


def test_resume_choices_must_match_n(tiny: EngineProcess) -> None:
    with engine_client(tiny) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "n": 3, "resume": {"choices": [{}, {}]}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "resume.choices"
        r = c.post("/v1/chat/completions", json={**CHAT, "n": 2, "resume": {"tokens": [5]}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "resume"
        r = c.post("/v1/chat/completions", json={**CHAT, "n": 2, "resume": {
            "choices": [{"tokens": [5, 6], "segments": [1]}, {}]}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "resume.choices[0].segments"


def test_a_reply_its_tokens_already_ended_ends_at_once(tiny: EngineProcess) -> None:
    _, pieces = marked_stream(tiny, "/v1/chat/completions", CHAT)
    tokens = [t for _, ids in pieces for t in ids][:6]
    assert len(tokens) == 6  # the first 6 of 48: a reply of max_tokens 6 made these, and ended
    body = {**CHAT, "max_tokens": 6}
    _, rest = marked_stream(tiny, "/v1/chat/completions", {**body, "resume": {"tokens": tokens}})
    chunks = events(b"".join(p for p, _ in rest))
    assert chat_text(chunks) == ""
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_seeded_sampling_continues_with_the_same_draws(tiny: EngineProcess) -> None:
    body = {**CHAT, "temperature": 1.0, "seed": 1234}
    whole = marked_stream(tiny, "/v1/chat/completions", body)
    want = chat_text(events(b"".join(p for p, _ in whole[1])))
    other = chat_text(events(b"".join(p for p, _ in marked_stream(tiny, "/v1/chat/completions", {**body, "seed": 1})[1])))
    assert other != want  # the seed matters, so the same text below is the same draws
    for at in cuts(whole[1]):
        before, after = cut_and_continue(tiny, "/v1/chat/completions", body, at, whole)
        assert chat_text(events(before)) + chat_text(events(after)) == want


@pytest.mark.parametrize(("resume", "param", "words"), [
    ({"tokens": [10**9]}, "resume.tokens", "outside the vocabulary"),
    ({"tokens": [1, 2], "segments": [1]}, "resume.segments", "add up to 1"),
    ({"tokens": [1], "text": "a"}, "resume.text", "not both"),
    ({"tokens": list(range(100))}, "resume", "budget of 50"),
    ({"bogus": 1}, "resume", "bogus"),
])
def test_a_bad_resume_is_a_400_naming_it(tiny: EngineProcess, resume: dict[str, Any], param: str, words: str) -> None:
    with engine_client(tiny) as c:
        resp = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50, "stream": False, "resume": resume})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert words in resp.json()["error"]["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


def calls_of(chunks: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The tool calls in chat chunks: (name, arguments) by index, the arguments' deltas joined."""
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for call in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"].get("arguments") or ""
    return [(name, args) for name, args in (calls[i] for i in sorted(calls))]


def test_a_tool_call_cut_anywhere_arrives_whole_and_once(smol: EngineProcess) -> None:
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 60,
            "temperature": 0, "tools": [WEATHER], "tool_choice": "required"}
    whole = marked_stream(smol, "/v1/chat/completions", body)
    want = events(b"".join(p for p, _ in whole[1]))
    assert [name for name, _ in calls_of(want)] == ["get_weather"]
    last = len(whole[1]) - 2
    for at in sorted({0, last // 3, 2 * last // 3, last}):  # at its start, through the call, and the last mark
        before, after = cut_and_continue(smol, "/v1/chat/completions", body, at, whole)
        got = events(before) + events(after)
        assert calls_of(got) == calls_of(want), at
        assert got[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.slow  # SmolLM2 continued from 8 cuts: about 11 s on 2 cores (`make test` stays near 10 minutes)
def test_a_json_schema_reply_cut_anywhere_keeps_its_grammar(smol: EngineProcess) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Make up a person."}], "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    whole = marked_stream(smol, "/v1/chat/completions", body)
    want = chat_text(events(b"".join(p for p, _ in whole[1])))
    assert set(json.loads(want)) == {"name", "age"}
    for at in range(0, len(whole[1]) - 1, 4):
        before, after = cut_and_continue(smol, "/v1/chat/completions", body, at, whole)
        assert chat_text(events(before)) + chat_text(events(after)) == want, at


def logprob_tokens(chunks: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Each token's text and log probability, in the order the chat chunks carried them."""
    return [(lp["token"], lp["logprob"]) for c in chunks if c["choices"]
            for lp in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]


def test_log_probabilities_held_with_a_tool_call_at_the_cut_still_arrive(smol: EngineProcess) -> None:
    """The tool-call parser holds a call's text, and its tokens' log probabilities, until the call
    is whole: a cut inside it must not lose them (the marks do not name those tokens yet, so the
    next engine makes them again)."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 60,
            "temperature": 0, "tools": [WEATHER], "tool_choice": "required", "logprobs": True, "top_logprobs": 2}
    whole = marked_stream(smol, "/v1/chat/completions", body)
    want = events(b"".join(p for p, _ in whole[1]))
    tokens = logprob_tokens(want)
    assert calls_of(want) and tokens
    # the writes that sent no log probabilities: the call's text (and theirs) was still held
    held = [at for at, (raw, _) in enumerate(whole[1][:-1]) if not logprob_tokens(events(raw))]
    assert held, "no write held a token back: the parser released the call early"
    assert all(not ids for at, (_, ids) in enumerate(whole[1][:-1]) if at in held)  # not delivered yet
    for at in sorted({held[0], held[len(held) // 2], held[-1]}):
        before, after = cut_and_continue(smol, "/v1/chat/completions", body, at, whole)
        got = logprob_tokens(events(before) + events(after))
        assert [t for t, _ in got] == [t for t, _ in tokens], at
        assert [p for _, p in got] == pytest.approx([p for _, p in tokens], abs=1e-3), at
        assert calls_of(events(before) + events(after)) == calls_of(want), at


def test_each_choices_held_log_probabilities_arrive_after_a_cut(smol: EngineProcess) -> None:
    """As above, for an `n` = 2 stream: each choice's marks leave out the tokens it holds."""
    n = 2
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 40, "n": n,
            "temperature": 0, "tools": [WEATHER], "tool_choice": "required", "logprobs": True,
            "stream_options": {"include_usage": True}}
    with engine_client(smol) as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                                            headers={MARKS_HEADER: "1"}) as resp:
        rid, created = resp.headers[REPLY_HEADER].split(" ")
        raw = resp.read()
    writes = choice_writes(raw)

    def tokens_of(chunks: list[dict[str, Any]], k: int) -> list[str]:
        return [lp["token"] for c in chunks for ch in c["choices"] if ch["index"] == k
                for lp in ((ch.get("logprobs") or {}).get("content") or [])]

    want = [tokens_of(events(raw), k) for k in range(n)]
    assert all(want) and want[0] == want[1]
    held = [at for at, (_, chunks, _, closed) in enumerate(writes[:-1])
            if not closed and not tokens_of(chunks, 0) and not tokens_of(chunks, 1)]
    assert held and all(not writes[at][2] for at in held)
    for at in sorted({held[len(held) // 2], held[-1]}):
        delivered = writes[:at + 1]
        choices = [{"tokens": [t for i, _, ids, _ in delivered if i == k for t in ids],
                    "segments": [len(ids) for i, _, ids, _ in delivered if i == k],
                    "ended": any(closed for i, _, _, closed in delivered if i == k)} for k in range(n)]
        with engine_client(smol) as c, c.stream(
                "POST", "/v1/chat/completions", headers={MARKS_HEADER: "1"},
                json={**body, "stream": True, "resume": {"choices": choices, "id": rid, "created": int(created)}}) as resp:
            after = events(resp.read())
        before = [chunk for _, chunks, _, _ in delivered for chunk in chunks]
        assert [tokens_of(before, k) + tokens_of(after, k) for k in range(n)] == want, at
        assert after[-1]["usage"]["completion_tokens"] == events(raw)[-1]["usage"]["completion_tokens"], at
