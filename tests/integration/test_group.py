"""An engine group on localhost (issue 30, docs/distributed.md): two processes of the tiny model
joined by mx.distributed's ring backend, its weights split between them (tensor parallel),
answer as one engine does. Rank 0 serves; rank 1 replays its turns."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mlxd.engine.cache import kv_files
from mlxd.engine.models.random_model import build_random_llama
from mlxd.protocol.exit_codes import ExitCode
from mlxd.protocol.process import MARKS_HEADER, REPLY_HEADER
from tests.support import (
    NO_EOS,
    EngineProcess,
    SupervisorProcess,
    engine_client,
    engine_env,
    free_port,
    pid_alive,
    private_socket_dir,
    running_engine,
    serving,
    wait_for,
)

BATCH = ("--batch", "4")


@contextlib.contextmanager
def group_of_two(model: Path, rank1_model: Path | None = None, ready: bool = True,
                 extra: tuple[str, ...] = (), rank1_launcher: list[str] | None = None) -> Iterator[list[EngineProcess]]:
    """Rank 0 and rank 1 of a group, rank 0 ready unless `ready` is False (both stopped after)."""
    where = private_socket_dir()
    hostfile = where / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    blas = {"MLXD_BLAS": "off"} if rank1_launcher else {}  # a launcher's patches do not survive the BLAS re-exec
    ranks = [EngineProcess(rank1_model if r and rank1_model else model, "tiny", *BATCH, *extra,
                           "--group-control", str(where / "ctl.sock"), socket_dir=where,
                           launcher=rank1_launcher if r else None,
                           env=engine_env(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile), **(blas if r else {})))
             for r in (0, 1)]
    try:
        if ready:
            ranks[0].wait_ready()
        yield ranks
    finally:
        for rank in ranks:
            rank.stop()


@pytest.fixture(scope="module")
def group(tiny_model: Path) -> Iterator[EngineProcess]:
    with group_of_two(tiny_model) as ranks:
        yield ranks[0]


@pytest.fixture(scope="module")
def alone(tiny_model: Path) -> Iterator[EngineProcess]:
    """One process with the same flags: what the group must answer."""
    with running_engine(tiny_model, "tiny", *BATCH) as engine:
        yield engine


def chat(engine: EngineProcess, content: str, **body: Any) -> str:
    answer = engine.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 32, "temperature": 0,
        "logit_bias": NO_EOS, **body}).json()
    return str(answer["choices"][0]["message"]["content"])


def kept_mb(rank: EngineProcess, n: int, what: str = "keeps") -> float:
    [(kept, peak)] = re.findall(rf"rank {n} keeps ([\d.]+) MB of the model's weights \(at most ([\d.]+) MB", rank.log())
    return float(kept if what == "keeps" else peak)


def weights_mb(model: Path) -> float:
    return sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e6


def test_each_rank_reads_only_its_part_of_the_weights(group: EngineProcess, tiny_model: Path) -> None:
    # tensor parallel: the projections halved; the embeddings and norms whole on each rank
    assert kept_mb(group, 0) < 0.8 * weights_mb(tiny_model)


def test_a_group_answers_as_one_engine_alone_and_batched(group: EngineProcess, alone: EngineProcess) -> None:
    assert chat(group, "Tell me about the sea.") == chat(alone, "Tell me about the sea.")
    prompts = [f"Story number {i}, please." for i in range(4)]
    with ThreadPoolExecutor(4) as pool:  # four rows at once: the batch lane, on both ranks
        together = list(pool.map(lambda p: chat(group, p), prompts))
    assert together == [chat(alone, p) for p in prompts]
    seeded = {"temperature": 1.0, "seed": 7}
    assert chat(group, "Sample this.", **seeded) == chat(alone, "Sample this.", **seeded)


def test_unseeded_sampling_and_n_choices_keep_the_ranks_in_step(group: EngineProcess, alone: EngineProcess) -> None:
    """Rank 0 seeds every rank's generator alike; an n > 1 request's choices share one prefill
    on every rank. Were the ranks apart, the next greedy answer would not be the engine's."""
    with ThreadPoolExecutor(3) as pool:
        sampled = list(pool.map(lambda i: chat(group, f"Anything {i}", temperature=1.0), range(3)))
    assert all(sampled)
    answer = group.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Three ways"}], "max_tokens": 16, "n": 3, "temperature": 0,
        "logit_bias": NO_EOS}).json()
    assert len({c["message"]["content"] for c in answer["choices"]}) == 1
    assert chat(group, "Tell me about the sea.") == chat(alone, "Tell me about the sea.")


def test_a_caller_that_leaves_mid_stream_leaves_the_ranks_in_step(group: EngineProcess, alone: EngineProcess) -> None:
    body = {"messages": [{"role": "user", "content": "A long one"}], "max_tokens": 2000, "temperature": 0,
            "logit_bias": NO_EOS, "stream": True}
    with group.client.stream("POST", "/v1/chat/completions", json=body) as resp:
        for n, _ in enumerate(resp.iter_lines()):
            if n > 10:
                break  # leaves: the rows go at the same step on both ranks
    wait_for(lambda: group.stats()["lanes"]["batch"] + group.stats()["lanes"]["serial"] == 0, 10)
    assert chat(group, "Tell me about the sea.") == chat(alone, "Tell me about the sea.")


def test_structured_output_holds_on_every_rank(group: EngineProcess, alone: EngineProcess) -> None:
    """Each rank compiles the grammar rank 0 sends: held rows, alone and batched, answer as one
    engine's (a rank without the mask would sample other tokens, and the next answer would differ)."""
    held = {"guided_regex": "[a-z]{3,12}( [a-z]{2,9}){3,8}\\.", "logit_bias": {}}  # words, then a stop
    want = [chat(alone, f"Fill it in {i}", **held) for i in range(3)]
    assert all(re.fullmatch(r"[a-z]{3,12}( [a-z]{2,9}){3,8}\.", w) for w in want), want
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda i: chat(group, f"Fill it in {i}", **held), range(3))) == want
    assert chat(group, "Tell me about the sea.") == chat(alone, "Tell me about the sea.")


def test_what_the_group_cannot_carry_yet_is_a_400(group: EngineProcess) -> None:
    resp = group.client.post("/admin/adapters", json={"id": "a", "path": "/nowhere"})  # a closure on the GPU thread
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "unsupported_in_group"


def test_n_gram_drafts_in_a_group_are_rank_0s_decisions_and_answer_as_one_engine(
        tiny_model: Path, alone: EngineProcess) -> None:
    """Whether a step drafts and what it checks follow rank 0's clock: the other rank takes each
    decision from rank 0 (spec/agreement.py), so both make the same passes, alone (the serial
    lane) and batched. Were they apart, a split pass would sum different rows and the answers
    would not be one engine's."""
    prompts = ["Tell me about the sea.", "Count with me: one two three one two three one two three"]
    with group_of_two(tiny_model, extra=("--draft", "ngram")) as ranks:
        drafting = ranks[0]
        for prompt in prompts:
            assert chat(drafting, prompt, max_tokens=160) == chat(alone, prompt, max_tokens=160)
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda i: chat(drafting, f"{prompts[i % 2]} ({i})", max_tokens=120), range(4)))
        assert together == [chat(alone, f"{prompts[i % 2]} ({i})", max_tokens=120) for i in range(4)]
        lanes = drafting.stats()["lanes"]
        assert lanes["draft_proposed"] > 0 and lanes["draft_accepted"] > 0 and lanes["draft_batch_passes"] > 0, lanes
        # Sampled drafts are accepted by draws from the generator every rank seeded alike: still in step after.
        with ThreadPoolExecutor(2) as pool:
            assert all(pool.map(lambda i: chat(drafting, f"{prompts[1]} [{i}]", temperature=1.0, max_tokens=100), range(2)))
        assert chat(drafting, prompts[0], max_tokens=60) == chat(alone, prompts[0], max_tokens=60)
        # A request that opts out decodes plainly on every rank (rank 1 learns it with the job).
        assert chat(drafting, prompts[1], max_tokens=60, speculation=False) == chat(alone, prompts[1], max_tokens=60)
        assert "no speculative decoding" not in drafting.log()


def test_rank_1_killed_mid_stream_ends_the_stream_and_the_group(tiny_model: Path) -> None:
    with group_of_two(tiny_model) as (rank0, rank1):
        body = {"prompt": "x", "max_tokens": 3000, "temperature": 0, "logit_bias": NO_EOS, "stream": True}
        started = time.monotonic()
        with rank0.client.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for n, _ in enumerate(lines):
                if n == 5:
                    os.kill(rank1.proc.pid, signal.SIGKILL)
                    break
            rest = "\n".join(lines)
        assert '"error"' in rest and "[DONE]" not in rest  # a clean error event, not a finished answer
        assert time.monotonic() - started < 30
        wait_for(lambda: rank0.proc.poll() is not None, 20, message=rank0.log)
        assert rank0.proc.returncode == ExitCode.GPU_THREAD_DIED
        # Whichever sees the loss first ends the engine: the group's watch over the control
        # socket, or the GPU thread's collective (MLX's ring backend raises; step_failure.py).
        # In a clean-clone run the GPU thread won and the watch never logged.
        log = rank0.log()
        assert "rank 1 went away" in log or "[ring] connection to a peer was lost" in log, log


def stream_until_cut(rank0: EngineProcess, act: Any) -> str:
    """A long stream from rank 0, `act()` after its fifth line: the rest of what it sent."""
    body = {"prompt": "x", "max_tokens": 3000, "temperature": 0, "logit_bias": NO_EOS, "stream": True}
    with rank0.client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        for n, _ in enumerate(lines):
            if n == 5:
                act()
                break
        return "\n".join(lines)


def test_a_stopped_rank_ends_the_group_after_its_heartbeat(tiny_model: Path) -> None:
    with group_of_two(tiny_model, extra=("--group-heartbeat", "2")) as (rank0, rank1):
        stopped = []

        def stop() -> None:
            os.kill(rank1.proc.pid, signal.SIGSTOP)  # rank 0 then waits for it in a collective
            stopped.append(time.monotonic())

        try:
            rest = stream_until_cut(rank0, stop)
            assert '"error"' in rest and "[DONE]" not in rest
            wait_for(lambda: rank0.proc.poll() is not None, 20, message=rank0.log)
        finally:
            os.kill(rank1.proc.pid, signal.SIGCONT)
        assert rank0.proc.returncode == ExitCode.GPU_THREAD_DIED
        assert 1.5 <= time.monotonic() - stopped[0] < 20  # its last beat came up to half a second before
        assert "rank 1 sent no heartbeat for 2 s" in rank0.log()


HANGING_RANK = [sys.executable, str(Path(__file__).parent / "hanging_rank.py")]


def test_a_rank_hung_in_a_turn_ends_the_group_after_the_turn_timeout(tiny_model: Path) -> None:
    with group_of_two(tiny_model, extra=("--group-heartbeat", "2", "--group-turn-timeout", "4"),
                      rank1_launcher=HANGING_RANK) as (rank0, rank1):
        assert chat(rank0, "Tell me about the sea.")  # its heartbeat goes on while a turn takes long
        hung = []

        def hang() -> None:
            os.kill(rank1.proc.pid, signal.SIGUSR1)  # its loop hangs; its beats go on
            hung.append(time.monotonic())

        rest = stream_until_cut(rank0, hang)
        assert '"error"' in rest and "[DONE]" not in rest
        wait_for(lambda: rank0.proc.poll() is not None, 20, message=rank0.log)
        assert rank0.proc.returncode == ExitCode.GPU_THREAD_DIED
        assert 3 <= time.monotonic() - hung[0] < 20
        assert "rank 1 has not finished a turn in 4 s" in rank0.log()
        assert "sent no heartbeat" not in rank0.log()


def test_a_rank_that_cannot_load_fails_the_groups_load_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    with group_of_two(tiny_model, rank1_model=tmp_path / "nothing-here", ready=False) as (rank0, _):
        wait_for(lambda: rank0.proc.poll() is not None, 60, message=rank0.log)
        assert rank0.proc.returncode == ExitCode.MODEL_LOAD_ERROR
        assert "rank 1 could not load the model" in rank0.log()


def test_a_model_whose_heads_do_not_split_is_a_load_error(tmp_path: Path) -> None:
    odd = build_random_llama(tmp_path / "three-heads", hidden_size=48, num_heads=3, num_kv_heads=3)
    with group_of_two(odd, ready=False) as (rank0, _):
        wait_for(lambda: rank0.proc.poll() is not None, 60, message=rank0.log)
        assert rank0.proc.returncode == ExitCode.MODEL_LOAD_ERROR
        assert "3 attention heads (3 for keys and values) do not split over 2 ranks" in rank0.log()


def rank_pids(sup: SupervisorProcess, rank: int) -> list[int]:
    """The pids the supervisor's log gives rank `rank` of model tiny's group, oldest first."""
    pattern = r"\[tiny\] engine pid (\d+) starting" if rank == 0 else rf"\[tiny\] rank {rank} pid (\d+) starting"
    return [int(p) for p in re.findall(pattern, sup.log())]


def test_the_supervisor_serves_a_group_and_starts_it_again_when_a_rank_dies(
        tiny_model: Path, tmp_path: Path, alone: EngineProcess) -> None:
    with serving(tiny_model, "tiny", tmp_path / "data", model_config="batch = 4\ndistributed = {ranks = 2}") as sup:
        client = sup.openai()
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 32, "temperature": 0, "logit_bias": NO_EOS}
        ask = [{"role": "user", "content": "Tell me about the sea."}]
        first = client.chat.completions.create(messages=ask, **body).choices[0].message.content  # type: ignore[call-overload]
        assert first == chat(alone, "Tell me about the sea.")
        # Every API reaches the group as it reaches one engine: the same greedy reply through each
        # (without the logit bias, which the Anthropic and Ollama APIs do not take).
        plain = client.chat.completions.create(model="tiny", messages=ask, max_tokens=12,  # type: ignore[call-overload]
                                               temperature=0).choices[0].message.content
        assert plain  # a reply to compare
        said = sup.anthropic().messages.create(model="tiny", max_tokens=12, messages=ask,  # type: ignore[arg-type]
                                              extra_body={"temperature": 0})
        assert "".join(b.text for b in said.content if b.type == "text") == plain
        ollama = sup.client.post("/api/chat", json={"model": "tiny", "messages": ask, "stream": False,
                                                   "options": {"temperature": 0, "num_predict": 12}})
        assert ollama.status_code == 200 and ollama.json()["message"]["content"] == plain
        response = client.responses.create(model="tiny", input=ask, max_output_tokens=12, temperature=0)  # type: ignore[arg-type]
        assert response.output_text == plain
        [follower] = rank_pids(sup, 1)
        # Rank 1 killed mid-stream: rank 0 sees it go and ends, the group is one engine that
        # crashed, and the reply goes on on the group started again (docs/resume.md).
        long = {**body, "max_tokens": 300}
        parts: list[str] = []
        for chunk in client.chat.completions.create(messages=ask, stream=True, **long):  # type: ignore[call-overload]
            if chunk.choices and chunk.choices[0].delta.content:
                if not parts:
                    os.kill(follower, signal.SIGKILL)
                parts.append(chunk.choices[0].delta.content)
        assert "[tiny] engine exited with 6" in sup.log()
        assert "going on on the next" in sup.log()
        assert "".join(parts) == chat(alone, "Tell me about the sea.", max_tokens=300)
        again = client.chat.completions.create(messages=ask, **body).choices[0].message.content  # type: ignore[call-overload]
        assert again == first  # served by a new group, both ranks started again
        assert len(rank_pids(sup, 0)) == len(rank_pids(sup, 1)) == 2
        drained = sup.client.post("/admin/drain", json={"model": "tiny"})
        assert drained.status_code == 200 and drained.json()["drained"][0]["model"] == "tiny"
        lease = sup.client.post("/admin/leases", json={"model": "tiny", "ttl_s": 60}).json()
        held = sup.client.post("/v1/chat/completions", headers={"X-MLXD-Lease": lease["id"]},
                               json={"messages": ask, **body})
        assert held.json()["choices"][0]["message"]["content"] == first
        assert sup.client.delete(f"/admin/leases/{lease['id']}").json()["deleted"] is True
        unloaded = sup.client.post("/admin/unload", json={"model": "tiny"})
        assert unloaded.status_code == 200 and unloaded.json()["state"] == "stopped"
        last = rank_pids(sup, 1)[-1]
        wait_for(lambda: not pid_alive(last), 10)  # no rank outlives the engine the pool stopped




def test_a_pipeline_group_answers_as_one_engine(tmp_path: Path) -> None:
    """mode = pipeline: each rank runs half the layers (mlx-lm pipelines qwen2, not llama)."""
    qwen = build_random_llama(tmp_path / "qwen", family="qwen2", num_layers=4, context=4096)
    with running_engine(qwen, "tiny", *BATCH) as one:
        want = [chat(one, "Tell me about the sea."), chat(one, "Story number 1, please.")]
    with group_of_two(qwen, extra=("--group-mode", "pipeline")) as (rank0, _):
        assert "rank 0 of 2 (ring, pipeline)" in rank0.log()
        assert [chat(rank0, "Tell me about the sea."), chat(rank0, "Story number 1, please.")] == want


def test_a_llama_pipeline_of_uneven_halves_answers_as_one_engine(tmp_path: Path) -> None:
    """mlx-lm does not pipeline llama; mlxd does: 3 layers, 2 on rank 0 and 1 on rank 1."""
    llama = build_random_llama(tmp_path / "llama3", num_layers=3, context=4096)
    asks = ["Tell me about the sea.", "Story number 1, please.", "A list of rivers."]
    with running_engine(llama, "tiny", *BATCH) as one:
        want = [chat(one, ask) for ask in asks]
    with group_of_two(llama, extra=("--group-mode", "pipeline")) as (rank0, rank1):
        assert [chat(rank0, ask) for ask in asks] == want
        with ThreadPoolExecutor(3) as pool:  # batched
            assert list(pool.map(lambda ask: chat(rank0, ask), asks)) == want
        assert "rank 1 of 2 (ring, pipeline)" in rank1.log()
        assert "pipeline: rank 0 runs layers 1-2 of 3" in rank0.log()
        assert "pipeline: rank 1 runs layers 0-0 of 3" in rank1.log()
        kept = [kept_mb(rank0, 0), kept_mb(rank1, 1)]
        assert kept[1] < kept[0] < weights_mb(llama)  # each its layers (and both the embeddings)
        # the split comes before the read: rank 1 never held the layers it does not run
        assert kept_mb(rank1, 1, "peak") < 0.75 * weights_mb(llama)


def test_uneven_pipeline_ranks_evict_the_same_prompt_cache_entries(tmp_path: Path) -> None:
    """Rank 0 holds 2 of 3 layers, rank 1 one, so an entry costs rank 1 half the bytes. With room
    for one of these entries on rank 0 and both on rank 1, rank 0 evicts the first as the second
    comes; rank 1 must too, or it would reuse the first's KV where rank 0 prefills it afresh."""
    llama = build_random_llama(tmp_path / "llama3", num_layers=3, context=4096)
    asks = ["Tell me about the sea, " * 20, "A list of rivers, " * 20, "Tell me about the sea, " * 20]
    small = ("--prompt-cache-bytes", "250000", "--ssd-cache-bytes", "0")  # RAM alone: no SSD hit to mask it
    with running_engine(llama, "tiny", *BATCH, *small) as one:
        want = [chat(one, ask) for ask in asks]
    with group_of_two(llama, extra=("--group-mode", "pipeline", *small)) as (rank0, _):
        assert [chat(rank0, ask) for ask in asks] == want
        ram = rank0.client.get("/admin/stats").json()["prompt_cache"]
        assert ram["ram_evicted"] >= 1 and ram["tokens_reused"] < 300  # the first ask's entry was gone


def ask_long(rank0: EngineProcess) -> tuple[str, int]:
    """A long prompt's greedy answer and how many of its tokens came from the prompt cache."""
    answer = rank0.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Tell me about the sea, " * 20}], "max_tokens": 16,
        "temperature": 0, "logit_bias": NO_EOS}).json()
    return answer["choices"][0]["message"]["content"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def stopped_in_order(ranks: list[EngineProcess]) -> None:
    """Rank 0 stops (SIGTERM: its cache to SSD, and the others' by its last turns); the others
    end on their own once it has gone."""
    assert ranks[0].stop() == 0
    wait_for(lambda: ranks[1].proc.poll() is not None, 30, message=ranks[1].log)
    assert ranks[1].proc.returncode == 0, ranks[1].log()


def rank_tier(root: Path, rank: int) -> Path:
    """Rank `rank`'s SSD tier under `root` (its fingerprint names its part)."""
    [tier] = [p.parent for p in root.glob("*/fingerprint.json") if json.loads(p.read_text()).get("split") == f"tensor {rank}/2"]
    return tier


def test_each_rank_keeps_its_part_of_the_prompt_cache_on_ssd_and_all_use_it_or_none(
        tiny_model: Path, alone: EngineProcess, tmp_path: Path) -> None:
    ssd = ("--ssd-cache-dir", str(tmp_path / "kv"))
    want = ask_long(alone)[0]
    with group_of_two(tiny_model, extra=ssd) as ranks:
        assert ask_long(ranks[0]) == (want, 0)
        stopped_in_order(ranks)
    written = [sorted(p.name for p in rank_tier(tmp_path / "kv", r).glob("*.safetensors")) for r in (0, 1)]
    assert written[0] and written[0] == written[1]  # each rank wrote its part of the same entries
    with group_of_two(tiny_model, extra=ssd) as ranks:
        text, cached = ask_long(ranks[0])
        assert text == want and cached > 100  # every rank restored its part from SSD
        assert ranks[0].client.get("/admin/stats").json()["prompt_cache"]["hits"]["ssd"] == 1
        stopped_in_order(ranks)
    for entry in rank_tier(tmp_path / "kv", 1).glob("*.safetensors"):
        entry.unlink()  # rank 1 lost its part: rank 0's alone must not be used
    with group_of_two(tiny_model, extra=ssd) as ranks:
        assert ask_long(ranks[0]) == (want, 0)


def test_an_idle_group_is_unloaded_whole(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "tiny", tmp_path / "data", model_config="idle_ttl_s = 1\ndistributed = {ranks = 2}") as sup:
        answer = sup.client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4})
        assert answer.status_code == 200
        [follower] = rank_pids(sup, 1)
        wait_for(lambda: not pid_alive(follower), 30, message=sup.log)  # the pool stopped the group for idling

        def state() -> str:
            engines = {e["model"]: e for e in sup.client.get("/admin/engines").json()["data"]}
            return str(engines["tiny"]["state"])

        # the follower ends as rank 0 does, a moment before the engine's owner says stopped
        wait_for(lambda: state() == "stopped", 10, interval=0.1, message=lambda: f"{state()}\n{sup.log()}")




def longest_file_of(tier: Path) -> int:
    """Tokens of the longest whole file in one rank's SSD tier (0: none yet)."""
    from tests.integration.test_checkpoints import longest_file

    return longest_file(tier, "*")

def test_a_groups_reply_continued_after_a_rank_died_starts_from_every_ranks_checkpoint(
        tiny_model: Path, tmp_path: Path) -> None:
    """Generation checkpoints in a group: each rank writes its part of the running reply's KV
    every 16 tokens; rank 1 is killed mid-reply (the group ends); the reply continued on a new
    group restores the checkpoint on every rank, prefills only what followed it, and gives the
    uninterrupted text."""
    from tests.integration.test_checkpoints import BODY, marked_ids, read_until

    kv = tmp_path / "kv"
    args = ("--generation-checkpoint", "16", "--ssd-write-behind", "off", "--ssd-cache-dir", str(kv))
    with running_engine(tiny_model, "tiny", *BATCH, "--ssd-cache-bytes", "0") as plain:
        _, want_ids, want_text = marked_ids(plain, BODY)
        prompt_tokens = plain.client.post("/v1/completions", json=BODY).json()["usage"]["prompt_tokens"]
    with group_of_two(tiny_model, extra=args) as ranks:
        with engine_client(ranks[0]) as c, c.stream("POST", "/v1/completions", json={**BODY, "stream": True},
                                                    headers={MARKS_HEADER: "1"}) as resp:
            reply = resp.headers[REPLY_HEADER]
            delivered, text = read_until(resp, 50)
            for rank in (0, 1):  # both ranks' checkpoints past the 48th token reached the disk
                wait_for(lambda r=rank: longest_file_of(rank_tier(kv, r)) >= prompt_tokens + 48, 30,  # type: ignore[misc]
                         message=ranks[rank].log)
            os.kill(ranks[1].proc.pid, signal.SIGKILL)
        wait_for(lambda: ranks[0].proc.poll() is not None, 30, message=ranks[0].log)
    assert delivered == want_ids[:len(delivered)] and want_text.startswith(text)
    saved = min(longest_file_of(rank_tier(kv, r)) for r in (0, 1))
    rid, created = reply.split(" ")
    resume = {**BODY, "resume": {"tokens": delivered, "id": rid, "created": int(created)}}
    cut = tmp_path / "cut"  # the same, but rank 1's last checkpoint lost (a write cut by the kill)
    shutil.copytree(kv, cut)
    tier = rank_tier(cut, 1)
    [last] = [p for p in tier.glob("*" + kv_files.SUFFIX) if len(kv_files.read_header(p).tokens) == longest_file_of(tier)]
    last.unlink()
    left = longest_file_of(tier)
    assert prompt_tokens <= left < saved  # its first checkpoint, the prompt's, is still there
    with group_of_two(tiny_model, extra=args) as ranks:
        rest = ranks[0].client.post("/v1/completions", json=resume).json()
        stats = ranks[0].client.get("/admin/stats").json()["prompt_cache"]
    assert stats["hits"]["ssd"] == 1
    assert stats["tokens_reused"] == min(saved, prompt_tokens + len(delivered) - 1) >= prompt_tokens + 48
    assert rest["choices"][0]["text"] == want_text
    with group_of_two(tiny_model, extra=(*args[:-1], str(cut))) as ranks:
        rest = ranks[0].client.post("/v1/completions", json=resume).json()
        stats = ranks[0].client.get("/admin/stats").json()["prompt_cache"]
    assert stats["hits"]["ssd"] == 1  # the longest checkpoint every rank still holds
    assert stats["tokens_reused"] == left
    assert rest["choices"][0]["text"] == want_text
