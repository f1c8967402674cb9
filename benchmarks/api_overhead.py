"""What speaking another API costs: the same stream as OpenAI chat, as Anthropic Messages, as
a Responses stream and as Ollama's NDJSON chat, through one supervisor and one engine (issues
13 and 28).

Figures, for Anthropic, Responses and Ollama against OpenAI chat:
  * decode tokens/s of the stream / an OpenAI chat stream's (targets: >= 0.98; Ollama >= 0.99)
  * added time to first token, p50 (targets: <= 2 ms; Ollama < 1 ms)
  * the supervisor's own cost per streamed event: splitting the engine's SSE, decoding the
    chunk and writing the caller's events (MessageStream, ResponseStream, OllamaStream), in
    this process

(A Responses request is stored, so its figure includes the store's write before the last
event: the end of its stream, not its first token or its decode rate.)

The four kinds take turns, each going first in turn, so machine noise hits all alike. In
a round all four send the same prompt (a leading round number), so they generate the same
tokens, greedy, and the engine runs with no prompt cache (`[pool] prompt_cache_bytes = 0`),
so none starts from another's prefill. A random-weight model almost never samples EOS; a
reply that ends early is left out of the decode figure. Decode is timed from the first
content event to the last, over the tokens the answer's usage counts. Warm-up rounds come
first.

  python benchmarks/api_overhead.py                       # random llama 256x2, built in a temp dir
  python benchmarks/api_overhead.py --model DIR --rounds 30 --tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed_stream(client: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str],
                 text: Any, used: Any, ndjson: bool = False) -> dict[str, Any]:
    """One stream: when it was sent, when each event with text came (`text(event)`), and the
    tokens its usage counted (`used(event)`, None for events without it). Events are SSE
    `data:` lines, or with `ndjson` whole lines (Ollama's)."""
    sent = time.perf_counter()
    stamps, tokens = [], 0
    with client.stream("POST", path, json=body, headers=headers) as resp:
        for line in resp.iter_lines():
            if ndjson:
                if not line:
                    continue
                event = json.loads(line)
            elif not line.startswith("data: {"):
                continue
            else:
                event = json.loads(line[6:])
            if text(event):
                stamps.append(time.perf_counter())
            if (n := used(event)) is not None:
                tokens = n
    return {"ttft": stamps[0] - sent, "stamps": stamps, "tokens": tokens}


def openai_stream(client: httpx.Client, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    return timed_stream(client, "/v1/chat/completions", body, {},
                        lambda c: c["choices"] and c["choices"][0]["delta"].get("content"),
                        lambda c: c["usage"]["completion_tokens"] if c.get("usage") else None)


def anthropic_stream(client: httpx.Client, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True}
    return timed_stream(client, "/v1/messages", body, {"anthropic-version": "2023-06-01"},
                        lambda e: e["type"] == "content_block_delta" and e["delta"].get("text"),
                        lambda e: e["usage"]["output_tokens"] if e["type"] == "message_delta" else None)


def responses_stream(client: httpx.Client, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"model": model, "input": prompt, "max_output_tokens": tokens, "temperature": 0, "stream": True}
    done = ("response.completed", "response.incomplete")
    return timed_stream(client, "/v1/responses", body, {},
                        lambda e: e["type"] == "response.output_text.delta" and e["delta"],
                        lambda e: e["response"]["usage"]["output_tokens"] if e["type"] in done else None)


def ollama_stream(client: httpx.Client, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "options": {"num_predict": tokens, "temperature": 0}}  # streamed: Ollama's default
    return timed_stream(client, "/api/chat", body, {}, lambda e: e["message"]["content"],
                        lambda e: e["eval_count"] if e["done"] else None, ndjson=True)


def decode_tps(run: dict[str, Any]) -> float | None:
    spread = run["stamps"][-1] - run["stamps"][0]
    return (run["tokens"] - 1) / spread if spread > 0 and len(run["stamps"]) > 1 else None


def translation_cost(events: int = 20000) -> dict[str, float]:
    """Microseconds per event for the supervisor's work on a stream, each API."""
    from mlxd.protocol.anthropic_stream import MessageStream
    from mlxd.protocol.chat_chunks import chunk_decoder
    from mlxd.protocol.ollama_answers import OllamaStream
    from mlxd.protocol.responses import ResponsesRequest, Shell
    from mlxd.protocol.responses_stream import ResponseStream
    from mlxd.supervisor.relay.sse import SseEvents

    chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": None, "logprobs": None}]}
    wire = b"data: " + json.dumps(chunk).encode() + b"\n\n"

    sse = SseEvents()
    started = time.perf_counter()
    for _ in range(events):
        for data in sse.feed(wire):
            assert data is not None
    split_us = (time.perf_counter() - started) / events * 1e6
    costs = {"sse_split_us": round(split_us, 2)}
    for name, translator in (("anthropic_event_us", MessageStream("m")),
                             ("responses_event_us", ResponseStream(Shell(ResponsesRequest(), "m"))),
                             ("ollama_event_us", OllamaStream("m", "chat", time.perf_counter()))):
        sse = SseEvents()
        started = time.perf_counter()
        for _ in range(events):
            for data in sse.feed(wire):
                assert data is not None
                translator.feed(chunk_decoder.decode(data))
        costs[name] = round((time.perf_counter() - started) / events * 1e6, 2)
    return costs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="MLX model dir (default: a random llama 256x2 built in a temp dir)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()

    from tests.support import SupervisorProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model) if a.model else Path(tmp) / "model"
        if not a.model:
            from mlxd.engine.models.random_model import build_random_llama

            build_random_llama(model, hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
                               intermediate_size=704, vocab_size=4096, context=8192)
        config = f'[pool]\nprompt_cache_bytes = 0\n\n[models.bench]\npath = "{model}"\n'
        sup = SupervisorProcess(config, Path(tmp) / "data").wait_up()
        try:
            client = httpx.Client(base_url=sup.url, timeout=600)
            kinds = {"openai": openai_stream, "anthropic": anthropic_stream, "responses": responses_stream,
                     "ollama": ollama_stream}
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
            for i in range(a.warmup + a.rounds):
                order = list(kinds)[i % len(kinds):] + list(kinds)[:i % len(kinds)]  # each kind goes first in turn
                for kind in order:
                    prompt = f"Request {i:04d}: write a long story about the sea."
                    run = kinds[kind](client, "bench", prompt, a.tokens)
                    if i >= a.warmup:
                        runs[kind].append(run)
            client.close()
        finally:
            sup.stop()
    full = {k: [r for r in v if r["tokens"] == a.tokens] for k, v in runs.items()}
    tps = {k: statistics.median([t for r in v if (t := decode_tps(r)) is not None]) for k, v in full.items()}
    ttft = {k: statistics.median(r["ttft"] for r in v) for k, v in runs.items()}
    out = {
        "model": str(a.model or "random llama 256x2"), "rounds": a.rounds, "tokens": a.tokens,
        "full_length_runs": {k: len(v) for k, v in full.items()},
        "decode_tps": {k: round(v, 2) for k, v in tps.items()},
        "decode_ratio": {k: round(tps[k] / tps["openai"], 4) for k in ("anthropic", "responses", "ollama")},
        "ttft_ms_p50": {k: round(v * 1000, 2) for k, v in ttft.items()},
        "added_ttft_ms_p50": {k: round((ttft[k] - ttft["openai"]) * 1000, 2)
                              for k in ("anthropic", "responses", "ollama")},
        "per_event": translation_cost(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
