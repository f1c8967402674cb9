"""A reply whose engine dies mid-answer goes on on the next engine (docs/resume.md): real
supervisors, real engines SIGKILLed under concurrent greedy streams, the official SDKs."""

from __future__ import annotations

import json
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from tests.support import SupervisorProcess, fake_supervisor, wait_for

NO_EOS = {"2": -100}  # the tiny model's EOS, biased away: every reply runs to max_tokens
POOL = "[pool]\ncrash_limit = 100\ncrash_window_s = 30\ndrain_timeout_s = 0.3\n"
ENV = {"MLXD_SPARE_ENGINE": "1", "MLXD_ENGINE_BACKOFF_S": "0.05"}


def resume_supervisor(model: Path, name: str, data: Path) -> Iterator[SupervisorProcess]:
    """A supervisor serving `model` as `name`, with a spare engine and quick restarts."""
    proc = SupervisorProcess(f'{POOL}\n[models.{name}]\npath = "{model}"\n', data, env=ENV).wait_up()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def sup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    yield from resume_supervisor(tiny_model, "tiny", tmp_path_factory.mktemp("resume"))


def engine_pid(sup: SupervisorProcess) -> int | None:
    """The model's engine (not the spare, which has no model yet)."""
    for child in psutil.Process(sup.proc.pid).children():
        with_model = child.cmdline()
        if with_model and with_model[0].startswith("mlxd engine"):
            return child.pid
        if with_model and with_model[0] == sys.executable and "--model" in with_model:
            return child.pid
    return None


class Killer:
    """SIGKILLs the model's engine `times` times, each a random while after a reply has begun."""

    def __init__(self, sup: SupervisorProcess, times: int, after_s: tuple[float, float] = (0.05, 0.4)) -> None:
        self.sup, self.times, self.after_s = sup, times, after_s
        self.kills = 0
        self.begun = threading.Event()  # set by the clients when a chunk came
        self.over = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Killer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.over.set()
        self.begun.set()
        self.thread.join(timeout=120)

    def _run(self) -> None:
        rng = random.Random(7)
        for _ in range(self.times):
            self.begun.wait(120)
            time.sleep(rng.uniform(*self.after_s))
            if self.over.is_set():
                return
            pid = engine_pid(self.sup)
            if pid is None:
                continue
            psutil.Process(pid).kill()
            self.kills += 1
            self.begun.clear()


Reply = tuple[str, Any, set[str]]  # text, usage, reply ids


def chat(client: openai.OpenAI, prompt: str, begun: threading.Event | None = None, max_tokens: int = 300,
         **extra: Any) -> Reply:
    text, usage, ids = [], None, set()
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, stream=True,
        logit_bias=NO_EOS, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            if begun is not None:
                begun.set()
    return "".join(text), usage, ids


def at_once(calls: list[Callable[[], Reply]]) -> list[Reply | BaseException]:
    out: list[Reply | BaseException] = [RuntimeError("did not run")] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


PROMPTS = [f"Tell me story number {i} about a {w}." for i, w in enumerate(
    ["cat", "ship", "tree", "river", "clock", "lamp", "road", "storm"])]


def test_eight_greedy_streams_keep_going_through_engine_kills(sup: SupervisorProcess) -> None:
    client = sup.openai()
    want = at_once([lambda p=p: chat(client, p) for p in PROMPTS])  # type: ignore[misc]
    assert all(not isinstance(r, BaseException) for r in want), want
    for _ in range(2):
        with Killer(sup, times=2) as killer:
            got = at_once([lambda p=p: chat(client, p, killer.begun) for p in PROMPTS])  # type: ignore[misc]
        errors = [r for r in got if isinstance(r, BaseException)]
        assert not errors, (errors, sup.log()[-4000:])
        assert killer.kills >= 1
        for (text, usage, ids), (want_text, want_usage, _) in zip(got, want, strict=True):  # type: ignore[misc]
            assert text == want_text
            assert len(ids) == 1  # one reply id, across engines
            assert (usage.prompt_tokens, usage.completion_tokens) == (want_usage.prompt_tokens, want_usage.completion_tokens)
    log = sup.log()
    assert "going on on the next" in log
    # Visible: the access log, /metrics and /admin/engines count the requests that went on
    assert re.search(r"POST /v1/chat/completions 200 tiny .* resumed=\d\(\+\d+ms", log), log[-3000:]
    # /metrics counts a request once its access record is written, which may be just after the
    # client has read its whole reply: read again for a moment until the two agree
    deadline = time.monotonic() + 10
    while True:
        metrics = sup.client.get("/metrics").text
        went_on = re.search(r'mlxd_resumes_total\{model="tiny",outcome="went_on"\} (\d+)', metrics)
        [row] = [r for r in sup.client.get("/admin/engines").json()["data"] if r["model"] == "tiny"]
        if (went_on is not None and row["resumes"] == int(went_on.group(1))) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert went_on is not None and int(went_on.group(1)) >= 2, metrics
    assert re.search(r'mlxd_resume_seconds_count\{model="tiny"\} (\d+)', metrics)
    assert row["resumes"] == int(went_on.group(1)) and row["resume_failures"] == 0


def test_a_stream_cut_by_an_unload_past_the_drain_timeout_goes_on_when_its_model_is_back(sup: SupervisorProcess) -> None:
    client = sup.openai()
    want, _, _ = chat(client, PROMPTS[1], max_tokens=1500)
    begun = threading.Event()
    unloaded: list[int] = []

    def unload() -> None:
        begun.wait(60)
        time.sleep(0.2)
        unloaded.append(sup.client.post("/admin/unload", json={"model": "tiny"}).status_code)

    thread = threading.Thread(target=unload)
    thread.start()
    got, usage, ids = chat(client, PROMPTS[1], begun, max_tokens=1500)
    thread.join(60)
    assert unloaded == [200]
    assert got == want and len(ids) == 1 and usage.completion_tokens == 1500
    assert "going on on the next" in sup.log()


def test_the_opt_out_header_ends_the_stream_with_the_crash_error(sup: SupervisorProcess) -> None:
    client = sup.openai().with_options(default_headers={"X-MLXD-Resume": "off"})
    wait_for(lambda: engine_pid(sup) is not None, 30)
    with Killer(sup, times=1) as killer, pytest.raises(openai.APIError) as info:
        chat(client, PROMPTS[0], killer.begun)
    assert "stopped unexpectedly" in str(info.value.message)


def n_choices(client: openai.OpenAI, begun: threading.Event | None = None) -> tuple[list[str], list[int], Any]:
    """A seeded chat stream of 3 choices: each one's text, the indexes its finish_reasons came
    for, and the usage."""
    texts, ends, usage = ["", "", ""], [], None
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=200, temperature=1.0, seed=5,
        n=3, stream=True, logit_bias=NO_EOS, stream_options={"include_usage": True})
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            ends += [choice.index] if choice.finish_reason else []
            if begun is not None and choice.delta.content:
                begun.set()
    return texts, sorted(ends), usage


def test_n_choices_keep_going_through_a_kill(sup: SupervisorProcess) -> None:
    client = sup.openai()
    want, want_ends, want_usage = n_choices(client)
    assert len(set(want)) == 3 and want_ends == [0, 1, 2]
    wait_for(lambda: engine_pid(sup) is not None, 30)
    with Killer(sup, times=1, after_s=(0.05, 0.15)) as killer:
        got, ends, usage = n_choices(client, killer.begun)
    assert killer.kills == 1
    assert got == want and ends == [0, 1, 2]  # each choice whole, and ended once
    assert usage.completion_tokens == want_usage.completion_tokens == 600
    # the access line comes once the handler returns, after the client has [DONE]; a client that
    # closes at once may see its handler cancelled first, and it had the whole answer: a 200 still
    wait_for(lambda: re.search(r"POST /v1/chat/completions 200 tiny .*resumed=1\(\+\d+ms\)", sup.log()),
             10, message=sup.log)


def test_a_whole_answer_cut_by_a_kill_is_answered_by_the_next_engine(sup: SupervisorProcess) -> None:
    client = sup.openai()
    body: dict[str, Any] = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                            "logit_bias": NO_EOS}
    want = client.completions.create(**body)
    wait_for(lambda: engine_pid(sup) is not None, 30)
    pid = engine_pid(sup)
    assert pid is not None
    threading.Timer(0.2, lambda: psutil.Process(pid).kill()).start()
    got = client.completions.create(**body)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage is not None and want.usage is not None
    assert got.usage.completion_tokens == want.usage.completion_tokens == 300
    assert engine_pid(sup) != pid
    assert re.search(r"POST /v1/completions 200 tiny .*resumed=1\(\+\d+ms\)", sup.log())  # it was cut, and went on


def test_streams_a_batched_step_ran_out_of_memory_on_go_on_on_the_same_engine(tiny_model: Path, tmp_path: Path) -> None:
    """A batched step that ran out of device memory (the faulty engine's OOMFAIL raises what MLX's
    CUDA allocator raises, once) ends its rows `engine_out_of_memory`; the supervisor goes on
    with each on the same engine, which gave the step's memory back and serves on."""
    env = {**ENV, "MLXD_ENGINE_MODULE": "tests.integration.faulty_engine", "MLXD_BLAS": "off",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    sup = SupervisorProcess(f'{POOL}batch = 4\n[models.tiny]\npath = "{tiny_model}"\n', tmp_path / "data", env=env).wait_up()
    try:
        client = sup.openai()
        prompts = ["OOMFAIL the first story", "the second story", "the third story"]
        got = at_once([lambda p=p: chat(client, p, max_tokens=40) for p in prompts])  # type: ignore[misc]
        errors = [r for r in got if isinstance(r, BaseException)]
        assert not errors, (errors, sup.log()[-4000:])
        log = sup.log()
        assert "out of memory" in log and "going on on the next" in log
        want = at_once([lambda p=p: chat(client, p, max_tokens=40) for p in prompts])  # type: ignore[misc]
        assert all(not isinstance(r, BaseException) for r in want), want
        for (text, usage, ids), (want_text, want_usage, _) in zip(got, want, strict=True):  # type: ignore[misc]
            assert text == want_text
            assert len(ids) == 1
            assert usage.completion_tokens == want_usage.completion_tokens == 40
        [row] = sup.client.get("/admin/engines").json()["data"]
        assert row["restarts"] == 0 and row["resumes"] >= 3  # every row went on, on the engine that ran out
    finally:
        sup.stop()


def test_a_request_that_keeps_killing_engines_ends_in_the_crash_error_after_the_bound(tmp_path: Path) -> None:
    sup = fake_supervisor(tmp_path, "hang", config="[pool]\nresume_attempts = 1\n")
    try:
        resp = sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "engine_crashed"
        log = sup.log()
        assert log.count("stopped answering its health check") == 2  # the first engine, and the one it went on on
        assert "cut short 2 times (the last: its engine went away); ending it" in log
    finally:
        sup.stop()


def test_a_reply_that_runs_out_of_memory_past_the_bound_ends_in_the_out_of_memory_error(tmp_path: Path) -> None:
    """Every answer of the fake engine is its `engine_out_of_memory`: the request goes on once
    (resume_attempts = 1), on the same engine, then ends with that error, not `engine_crashed`."""
    sup = fake_supervisor(tmp_path, "out_of_memory", config="[pool]\nresume_attempts = 1\n")
    try:
        resp = sup.client.post("/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "x"}]})
        assert resp.status_code == 500
        error = resp.json()["error"]
        assert error["code"] == "engine_out_of_memory" and "ran out of device memory" in error["message"]
        log = sup.log()
        assert "cut short 2 times (the last: out of device memory); ending it" in log
        [row] = sup.client.get("/admin/engines").json()["data"]
        assert row["restarts"] == 0  # it ran out of memory; it did not die
    finally:
        sup.stop()


@pytest.fixture(scope="module")
def smol_sup(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    yield from resume_supervisor(smollm2, "smol", tmp_path_factory.mktemp("resume-smol"))


def anthropic_reply(sup: SupervisorProcess, prompt: str, begun: threading.Event | None = None) -> Reply:
    text, ids = [], set()
    with sup.anthropic().messages.stream(model="smol", max_tokens=80, extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": prompt}]) as stream:
        for event in stream:
            if event.type == "message_start":
                ids.add(event.message.id)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text.append(event.delta.text)
                if begun is not None:
                    begun.set()
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == "".join(text)
    return "".join(text), final.usage, ids


def responses_reply(sup: SupervisorProcess, prompt: str, begun: threading.Event | None = None) -> Reply:
    text, ids, usage = [], set(), None
    for event in sup.openai().responses.create(model="smol", input=prompt, max_output_tokens=80, temperature=0,
                                               stream=True):
        if event.type == "response.output_text.delta":
            text.append(event.delta)
            if begun is not None:
                begun.set()
        elif event.type == "response.completed":
            ids.add(event.response.id)
            usage = event.response.usage
            assert event.response.output_text == "".join(text)
    return "".join(text), usage, ids


def ollama_reply(sup: SupervisorProcess, prompt: str, begun: threading.Event | None = None) -> Reply:
    """Ollama's /api/chat, streamed (NDJSON): its text, and its last line's counts as usage."""
    text, final = [], None
    body = {"model": "smol", "messages": [{"role": "user", "content": prompt}], "stream": True,
            "options": {"temperature": 0, "num_predict": 80}}
    with sup.client.stream("POST", "/api/chat", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line:
                continue
            event = json.loads(line)
            assert "error" not in event, event
            if piece := event.get("message", {}).get("content"):
                text.append(piece)
                if begun is not None:
                    begun.set()
            if event.get("done"):
                final = event
    assert final is not None
    return "".join(text), None, set()


@pytest.mark.slow  # SmolLM2 engines restarted under two APIs' streams: about 15 s each on 2 cores
@pytest.mark.parametrize("api", ["anthropic", "responses", "chat", "ollama"])
def test_real_text_goes_on_through_a_kill_in_every_streaming_api(smol_sup: SupervisorProcess, api: str) -> None:
    prompts = ["Explain how a lighthouse works.", "Write a short poem about autumn rain."]

    def ask(prompt: str, begun: threading.Event | None = None) -> Reply:
        if api == "anthropic":
            return anthropic_reply(smol_sup, prompt, begun)
        if api == "responses":
            return responses_reply(smol_sup, prompt, begun)
        if api == "ollama":
            return ollama_reply(smol_sup, prompt, begun)
        client = smol_sup.openai()
        stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=80, temperature=0, stream=True)
        text = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                if begun is not None:
                    begun.set()
        return "".join(text), None, set()

    want = at_once([lambda p=p: ask(p) for p in prompts])  # type: ignore[misc]
    assert all(not isinstance(r, BaseException) for r in want), want
    with Killer(smol_sup, times=1, after_s=(0.3, 0.8)) as killer:
        got = at_once([lambda p=p: ask(p, killer.begun) for p in prompts])  # type: ignore[misc]
    assert killer.kills == 1
    assert not [r for r in got if isinstance(r, BaseException)], (got, smol_sup.log()[-3000:])
    for (text, usage, ids), (want_text, want_usage, _) in zip(got, want, strict=True):  # type: ignore[misc]
        assert text == want_text
        assert len(ids) <= 1
        if usage is not None:
            assert usage.output_tokens == want_usage.output_tokens


@pytest.mark.slow  # SmolLM2 prefilling a long prompt twice: about 15 s on 2 cores
def test_a_kill_during_prefill_sends_the_request_again_as_it_was(smol_sup: SupervisorProcess) -> None:
    client = smol_sup.openai()
    # A prompt no earlier request began with: the prompt cache has none of it, so it prefills for seconds
    prompt = f"Summary {time.time_ns()}, in one line: " + "the tide comes in and the tide goes out. " * 45
    wait_for(lambda: engine_pid(smol_sup) is not None, 60)
    pid = engine_pid(smol_sup)
    assert pid is not None

    def kill_while_prefilling() -> None:
        in_flight = lambda: next(r for r in smol_sup.client.get("/admin/engines").json()["data"])["in_flight"]  # noqa: E731
        wait_for(lambda: in_flight() == 1, 30)
        time.sleep(0.3)  # the prompt (about 500 tokens) takes seconds to prefill here
        psutil.Process(pid).kill()

    killer = threading.Thread(target=kill_while_prefilling)
    killer.start()
    got, _, ids = chat_smol(client, prompt)
    killer.join(60)
    assert engine_pid(smol_sup) != pid
    again, _, _ = chat_smol(client, prompt)  # uninterrupted
    assert got == again and got and len(ids) == 1
    assert "went away after 0 tokens" in smol_sup.log()


def chat_smol(client: openai.OpenAI, prompt: str) -> Reply:
    text, ids = [], set()
    for chunk in client.chat.completions.create(model="smol", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=24, temperature=0, stream=True):
        ids.add(chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    return "".join(text), None, ids


@pytest.mark.parametrize(("resume", "param"), [
    ({"tokens": [1, 2], "segments": [5]}, "resume.segments"),
    ({"tokens": [-1]}, "resume.tokens[0]"),
    ("yes", "resume"),
])
def test_a_bad_resume_through_the_supervisor_is_an_openai_400_naming_it(
        sup: SupervisorProcess, resume: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sup.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                             extra_body={"resume": resume})
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == param, info.value.body
