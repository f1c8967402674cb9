"""The prompt cache in real engines: prefixes shared between clients and grown over turns (in
both lanes, with the official OpenAI SDK), and the SSD tier across engine restarts, damaged
files, an unusable dir and a full disk."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support import NO_EOS, EngineProcess, openai_client, running_engine, wait_for

SYSTEM = "You are a careful assistant for a team of engineers. " * 12  # a long shared system prompt
LONG_PROMPT = "The lighthouse keeper wrote a letter every night. " * 40


def chat(client: openai.OpenAI, messages: list[dict[str, str]], **kw: Any) -> Any:
    args: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0,
                            "logit_bias": NO_EOS, **kw}
    return client.chat.completions.create(**args)


def cached(answer: Any) -> int:
    return int(answer.usage.prompt_tokens_details.cached_tokens)


def conversations(engine: EngineProcess, turns: int, together: bool) -> list[list[tuple[int, int]]]:
    """Two clients sharing SYSTEM, alternating (or asking at once) for `turns` turns, each turn
    sending the whole transcript back with the reply as text (re-tokenized by the template).
    Per client and turn: (prompt tokens, cached tokens)."""
    history = {name: [{"role": "system", "content": SYSTEM}] for name in ("ada", "bob")}
    seen: dict[str, list[tuple[int, int]]] = {"ada": [], "bob": []}
    with openai_client(engine) as client, cf.ThreadPoolExecutor(2) as pool:
        for turn in range(turns):
            for name in history:
                history[name].append({"role": "user", "content": f"{name}, question {turn}: what next?"})
            names = list(history)
            if together:
                answers = list(pool.map(lambda n: chat(client, history[n]), names))
            else:
                answers = [chat(client, history[n]) for n in names]
            for name, answer in zip(names, answers, strict=True):
                seen[name].append((answer.usage.prompt_tokens, cached(answer)))
                history[name].append({"role": "assistant", "content": answer.choices[0].message.content})
    return [seen["ada"], seen["bob"]]


@pytest.mark.parametrize("lane", ["serial", "batch"])
def test_two_clients_sharing_a_system_prompt_hit_it_and_then_their_own_history_every_turn(
    tiny_model: Path, lane: str,
) -> None:
    extra = ("--batch", "4") if lane == "batch" else ()
    with running_engine(tiny_model, "m", *extra) as engine:
        ada, bob = conversations(engine, turns=4, together=lane == "batch")
        if lane == "serial":
            # bob's first turn finds ada's: the system prompt (and the template around it) is shared
            assert bob[0][1] >= 0.8 * bob[0][0], bob
        for turns in (ada, bob):
            for (prev_prompt, _), (_, hit) in itertools.pairwise(turns):
                # every later turn reuses at least the whole previous prompt, whatever the
                # reply re-tokenized into: the entry serves any prefix of itself
                assert hit >= prev_prompt, turns
        stats = engine.stats()["prompt_cache"]
        assert stats["hits"]["ram"] >= 6 and stats["tokens_reused"] > 0
        assert stats["ram"]["entries"] >= 2
        if lane == "batch":
            assert engine.stats()["lanes"]["width"] == 4


def test_a_reply_sent_back_differently_still_hits_the_previous_prompt(tiny_model: Path) -> None:
    with running_engine(tiny_model, "m") as engine, openai_client(engine) as client:
        messages = [{"role": "user", "content": LONG_PROMPT}]
        first = chat(client, messages)
        # the client edits the reply (as agents that strip or rewrite thinking do)
        messages += [{"role": "assistant", "content": "A different reply. " + first.choices[0].message.content[::-1]},
                     {"role": "user", "content": "And then?"}]
        second = chat(client, messages)
        assert cached(second) >= first.usage.prompt_tokens - 1


def stop(engine: EngineProcess) -> None:
    assert engine.stop() == 0


def test_the_cache_survives_an_engine_restart_with_the_same_greedy_output(smollm2: Path, tmp_path: Path) -> None:
    kv = ("--ssd-cache-dir", str(tmp_path / "kv"))
    half = LONG_PROMPT[:len(LONG_PROMPT) // 2]  # about 200 tokens: SmolLM2 prefills them at 60 a second here
    prompt = [{"role": "user", "content": half + "Summarize the story in one sentence."}]
    with running_engine(smollm2, "m", "--ssd-cache-bytes", "0") as cold_engine, openai_client(cold_engine) as c:
        cold = chat(c, prompt, max_tokens=20, logit_bias={})  # no SSD tier, a fresh engine: the reference
    with running_engine(smollm2, "m", *kv) as first, openai_client(first) as c:
        assert cached(chat(c, prompt, max_tokens=20, logit_bias={})) == 0
        assert wait_for(lambda: first.stats()["prompt_cache"]["ssd"]["entries"] >= 1, 30)  # written behind
    with running_engine(smollm2, "m", *kv) as second, openai_client(second) as c:
        warm = chat(c, prompt, max_tokens=20, logit_bias={})
        stats = second.stats()["prompt_cache"]
    assert cached(warm) >= cold.usage.prompt_tokens - 1
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert stats["hits"]["ssd"] == 1 and stats["ssd"]["restores"] == 1


def test_damaged_files_are_quarantined_and_the_request_is_answered_as_a_miss(tiny_model: Path, tmp_path: Path) -> None:
    kv = ("--ssd-cache-dir", str(tmp_path / "kv"))
    body = {"prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0}
    with running_engine(tiny_model, "m", *kv) as engine:
        reference = engine.client.post("/v1/completions", json=body).json()
        assert engine.client.post("/admin/drain", json={"resume": True}).json()["cache_complete"] is True
    files = list((tmp_path / "kv").glob("*/*.safetensors"))
    assert files
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0x01  # a bit flipped
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) - 7]))  # truncated
    with running_engine(tiny_model, "m", *kv) as engine:
        again = engine.client.post("/v1/completions", json=body).json()
        stats = engine.stats()["prompt_cache"]
        log = engine.log()
    assert again["choices"][0]["text"] == reference["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert stats["ssd"]["quarantined"] == len(files) and stats["ssd"]["restores"] == 0
    assert len(list((tmp_path / "kv").glob("*/quarantine/*"))) == len(files)
    assert "damaged" in log


def test_an_unusable_cache_dir_turns_the_ssd_tier_off_and_the_engine_serves(tiny_model: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a dir")
    with running_engine(tiny_model, "m", "--ssd-cache-dir", str(blocker / "kv")) as engine:
        answer = engine.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert answer.status_code == 200
        assert engine.stats()["prompt_cache"]["ssd"] is None
        assert "SSD prompt cache off" in engine.log()


FSIZE_LAUNCHER = (
    "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (%d, %d)); "
    "sys.argv[0] = 'mlxd.engine'; runpy.run_module('mlxd.engine', run_name='__main__', alter_sys=True)"
)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE stands in for a full disk on Linux")
def test_a_full_disk_is_counted_and_serving_goes_on(tiny_model: Path, tmp_path: Path) -> None:
    # Files over 64 KB fail with EFBIG (Python ignores SIGXFSZ), as writes to a full disk fail.
    limit = 64 * 1024
    launcher = [sys.executable, "-c", FSIZE_LAUNCHER % (limit, limit)]
    from tests.support import EngineProcess as Proc

    engine = Proc(tiny_model, "m", "--ssd-cache-dir", str(tmp_path / "kv"), launcher=launcher)
    try:
        engine.wait_ready()
        for i in range(3):
            resp = engine.client.post("/v1/completions", json={"prompt": f"{i} " + LONG_PROMPT, "max_tokens": 8})
            assert resp.status_code == 200
        # its writes (each reply's entry, and its prompt's checkpoint) all fail, and none is left under way;
        # the failed writes leave nothing behind. The idle engine hands its entries to the writer one at
        # a time, so three errors and an empty queue can come while the next write is still to start
        # (one run of `make test` saw its temp file): a temp file that stays is what fails this.
        assert wait_for(lambda: (s := engine.stats()["prompt_cache"])["ssd"]["write_errors"] >= 3
                        and s["writes_pending"] == 0 and not list((tmp_path / "kv").glob("*/tmp-*")), 30)
        stats = engine.stats()["prompt_cache"]
        assert stats["ssd"]["entries"] == 0 and stats["ram"]["entries"] == 3
        assert engine.client.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 4}).status_code == 200
    finally:
        engine.stop()


def test_a_drain_writes_what_is_in_ram_and_sigterm_does_too(tiny_model: Path, tmp_path: Path) -> None:
    # Write-behind and checkpoints off: only the drain and the stop write, so what each wrote is exact.
    kv = ("--ssd-cache-dir", str(tmp_path / "kv"), "--ssd-write-behind", "off", "--generation-checkpoint", "0")
    with running_engine(tiny_model, "m", *kv) as engine:
        for i in range(3):
            engine.client.post("/v1/completions", json={"prompt": f"{i} {LONG_PROMPT}", "max_tokens": 4})
        assert engine.stats()["prompt_cache"]["ssd"]["writes"] == 0
        drained = engine.client.post("/admin/drain", json={"resume": True}).json()
        stats = engine.stats()["prompt_cache"]
        assert drained["cache_complete"] is True and drained["cache_written_entries"] == 3
        assert drained["cache_written_bytes"] == stats["ssd"]["bytes"] > 0 and drained["cache_write_ms"] > 0
        assert stats["ssd"]["entries"] == stats["ram"]["entries"] == 3 and stats["writes_pending"] == 0
        engine.client.post("/v1/completions", json={"prompt": f"new {LONG_PROMPT}", "max_tokens": 4})
        os.kill(engine.proc.pid, 15)
        assert engine.proc.wait(20) == 0
        assert "on stop: prompt cache to SSD: 1 written" in engine.log()
    tiers = list((tmp_path / "kv").iterdir())
    assert len(tiers) == 1 and len(list(tiers[0].glob("*.safetensors"))) == 4  # the last one written on SIGTERM


def test_quantized_kv_is_cached_restored_and_kept_apart(head64_model: Path, tmp_path: Path) -> None:
    kv = ("--ssd-cache-dir", str(tmp_path / "kv"))
    body = {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    with running_engine(head64_model, "m", *kv, "--kv-bits", "4", "--kv-group-size", "32", "--batch", "4") as q:
        assert q.stats()["lanes"]["width"] == 1  # quantized KV runs one sequence at a time
        q.client.post("/v1/completions", json=body)
        assert q.client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        q.client.post("/admin/drain", json={"resume": True})
        q_bytes = q.stats()["prompt_cache"]["ssd"]["bytes"]
    with running_engine(head64_model, "m", *kv) as full:  # full precision: another dir, no hit
        answer = full.client.post("/v1/completions", json=body).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        full.client.post("/admin/drain", json={"resume": True})
        full_bytes = full.stats()["prompt_cache"]["ssd"]["bytes"]
    assert len(list((tmp_path / "kv").iterdir())) == 2
    assert q_bytes < full_bytes / 2  # 4-bit keys and values, with their scales
    with running_engine(head64_model, "m", *kv, "--kv-bits", "4", "--kv-group-size", "32") as q:
        answer = q.client.post("/v1/completions", json=body).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert q.stats()["prompt_cache"]["hits"]["ssd"] == 1


def test_kv_bits_that_do_not_fit_the_model_fail_its_load_clearly(tiny_model: Path) -> None:
    from tests.support import EngineProcess as Proc

    engine = Proc(tiny_model, "m", "--kv-bits", "8")  # the tiny model's heads have 16 values; groups are 64
    try:
        with pytest.raises(RuntimeError) as err:
            engine.wait_ready()
    finally:
        engine.stop()
    assert "--kv-group-size 64" in str(err.value)
