"""Rows with images that start together prefill as one batch in a real engine: their vision
towers and prompts at once (engine/gpu/image_batch.py), each answering as it does alone.

The requests are made to start in one turn (support.start_in_one_turn): a text stream holds
the engine's KV budget while they queue, and leaves once all of them wait.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tests.integration.test_vision import image_message, png
from tests.support import engine_client, lanes, running_engine, start_in_one_turn

MAX_TOKENS = 10


def no_eos(model: Path) -> dict[str, float]:
    ids = json.loads((model / "generation_config.json").read_text())["eos_token_id"]
    return {str(i): -100.0 for i in (ids if isinstance(ids, list) else [ids])}


def chat(engine: Any, messages: list[dict[str, Any]], bias: dict[str, float]) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "logit_bias": bias}
    with engine_client(engine) as c:
        resp = c.post("/v1/chat/completions", json=body)
        return {"status": resp.status_code, **resp.json()}


def test_image_rows_started_together_prefill_as_one_batch_and_answer_as_alone(vlms: dict[str, Path]) -> None:
    model = vlms["qwen2_vl"]
    bias = no_eos(model)
    sent = [image_message(png(30), "What is it?"), image_message(png(31, 140, 90), "Name its colours, please, in order."),
            image_message(png(32)), [{"role": "user", "content": "A text row among them."}]]
    with running_engine(model, "qwen", "--batch", "8", "--prompt-cache-bytes", "0") as engine:
        expected = [chat(engine, m, bias) for m in sent]
        assert [a["status"] for a in expected] == [200] * 4, expected
        alone_lanes = lanes(engine)
    assert alone_lanes["image_batches"] == 0
    need = sum(a["usage"]["prompt_tokens"] + MAX_TOKENS for a in expected) + 8
    with running_engine(model, "qwen", "--batch", "8", "--prompt-cache-bytes", "0",
                        "--kv-budget-tokens", str(need)) as engine:
        futures = start_in_one_turn(engine, [functools.partial(chat, engine, m, bias) for m in sent], bias)
        together = [f.result() for f in futures]
        after = lanes(engine)
    assert [a["status"] for a in together] == [200] * 4, together
    assert [a["choices"][0]["message"]["content"] for a in together] == \
        [a["choices"][0]["message"]["content"] for a in expected]
    assert [a["usage"] for a in together] == [a["usage"] for a in expected]
    assert (after["image_batches"], after["image_batch_rows"]) == (1, 3), (after, [a["usage"] for a in expected])


def test_a_batch_that_fails_starts_its_rows_one_by_one(
    vlms: dict[str, Path], closed_loop: Any, monkeypatch: Any,
) -> None:
    """In process: a batch lane given three image rows in one turn; when the batched prefill
    raises, each row starts alone and answers as with no batch at all."""
    from mlxd.engine.cache.prefix_cache import PrefixCache
    from mlxd.engine.gpu import image_batch
    from mlxd.engine.gpu.batch_lane import BatchLane
    from mlxd.engine.gpu.job import Job, SamplingParams
    from mlxd.engine.gpu.sequence import Sequence
    from mlxd.engine.gpu.stats import Stats
    from mlxd.engine.gpu.ticket import Ticket
    from mlxd.engine.models.image_memo import PromptMedia
    from mlxd.engine.models.loaded_model import LoadedModel
    from mlxd.engine.models.vision import Image

    loaded = LoadedModel(vlms["qwen2_vl"], "qwen")

    def run(stats: Stats) -> list[list[int]]:
        lane = BatchLane(loaded, stats, 64, 4, PrefixCache(0))
        seqs = []
        for seed in (40, 41, 42):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
            prompt, prompt_media = loaded.media_prompt(messages, None, None, PromptMedia.decoded([Image.of(png(seed))]))
            job = Job(prompt, 6, SamplingParams(temperature=0.0), [], Ticket(closed_loop), media=prompt_media)
            seqs.append(Sequence(job, loaded.tokenizer, set()))  # no EOS: each runs to max_tokens
            lane.admit(seqs[-1])
        ended: list[Any] = []
        while len(ended) < 3:
            ended += lane.step()
        assert all(seq.finish_reason == "length" for seq in seqs)
        return [seq.generated for seq in seqs]

    batched_stats = Stats()
    batched = run(batched_stats)
    assert (batched_stats.image_batches, batched_stats.image_batch_rows) == (1, 3)

    def broken(*_: Any) -> Any:
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(image_batch, "start_rows", broken)
    failed_stats = Stats()
    assert run(failed_stats) == batched
    assert failed_stats.image_batches == 0
