"""A fake engine for supervisor tests: same command line and socket contract, misbehaves on cue.

`MLXD_FAKE_MODE` picks the behaviour:
  ok            serve canned SSE tokens (default)
  boot_crash    exit 1 before binding the socket
  hang          answer /health once ready, then block the event loop forever after the first request
  exit_midway   stream 3 chunks, then exit 0 (a clean exit at the wrong time is still a crash)
  lingering_exit
                stream 3 chunks, then close every socket and exit 1 only `MLXD_FAKE_LINGER_S` (2)
                later: a GPU process killed with its device memory in use exits a while after
                its sockets closed, while its driver tears the context down
  flood         stream `max_tokens` numbered 8 KiB chunks as fast as the socket takes them
  cued          while the file `MLXD_FAKE_CUE` exists, exit at start with the code it holds;
                else serve as `ok` (a test breaks the model and mends it on cue)
  bad_drain     serve as `ok`, but answer POST /admin/drain with a report of the wrong shape
  out_of_memory answer a whole (not streamed) request with the engine's 500 `engine_out_of_memory`,
                as a batched step that ran out of device memory ends its rows
  tool_calls    serve as `ok`, but a streamed chat answer is one tool call, `get_weather`, its
                arguments split over chunks (the web page's tool-call view)
Other modes answer POST /admin/drain with a well-formed report of nothing drained.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time

from aiohttp import web

MODE = os.environ.get("MLXD_FAKE_MODE", "ok")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ready", "model": request.app["model_id"]})


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if MODE == "hang":
        time.sleep(3600)  # block the loop: /health stops answering too
    if not body.get("stream"):
        if MODE == "out_of_memory":
            return web.json_response({"error": {"message": "generation failed: out of memory", "type": "server_error",
                                                "code": "engine_out_of_memory"}}, status=500)
        if request.path == "/v1/chat/completions":
            return web.json_response({"object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": "fake"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
        return web.json_response({"object": "text_completion", "choices": [{"index": 0, "text": "fake", "finish_reason": "stop"}]})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if MODE == "flood":
        pad = "x" * 8192
        for i in range(int(body.get("max_tokens", 5))):
            await resp.write(b"data: " + json.dumps({"i": i, "pad": pad}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
    chat = request.path == "/v1/chat/completions"
    if MODE == "tool_calls" and chat:
        await stream_tool_call(resp)
        return resp
    for i in range(int(body.get("max_tokens", 5))):
        if chat:
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
        else:
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if MODE == "exit_midway" and i == 2:
            os._exit(0)
        if MODE == "lingering_exit" and i == 2:
            linger()
        await asyncio.sleep(0.01)  # a token every 10 ms, as an engine paces them
    if chat:
        end = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        await resp.write(b"data: " + json.dumps(end).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def linger() -> None:
    """Close every socket this process holds (the listener too: connections are refused), then
    exit 1 after `MLXD_FAKE_LINGER_S`, the event loop blocked meanwhile."""
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                os.close(int(fd))
    time.sleep(float(os.environ.get("MLXD_FAKE_LINGER_S", "2")))
    os._exit(1)


async def stream_tool_call(resp: web.StreamResponse) -> None:
    """One call as OpenAI streams it: id and name first, then the arguments in pieces, then the finish."""
    call = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    deltas: list[dict[str, object]] = [{"role": "assistant", "tool_calls": [call]}]
    deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": a}}]} for a in ('{"city": ', '"Paris"}')]
    for i, delta in enumerate([*deltas, {}]):
        finish = "tool_calls" if i == len(deltas) else None
        chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(0.01)  # paced as a real stream
    await resp.write(b"data: [DONE]\n\n")


async def drain(request: web.Request) -> web.Response:
    if MODE == "bad_drain":
        return web.json_response({"drained": "yes", "finished": "all"})
    return web.json_response({"drained": True, "finished": 0, "cancelled": 0, "waited_ms": 0.5,
                              "cache_written_bytes": 0, "resumed": True})


def exit_on_cue(cue: str) -> None:
    """Exit with the code the cue file holds, if it exists."""
    try:
        with open(cue) as f:
            code = int(f.read().strip() or 1)
    except FileNotFoundError:
        return
    print(f"ERROR fake: cued to exit with {code}", file=sys.stderr, flush=True)
    sys.exit(code)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--model-id")
    p.add_argument("--socket")
    p.add_argument("--parent-pid", type=int)
    p.add_argument("--max-context", type=int)
    p.add_argument("--batch")  # a number or auto
    p.add_argument("--memory-bytes", type=int)
    p.add_argument("--warmup")
    p.add_argument("--gather-ms", type=float)
    for flag in ("--prompt-cache-bytes", "--ssd-cache-bytes", "--ssd-cache-dir", "--kv-bits", "--kv-group-size",
                 "--ssd-write-behind"):
        p.add_argument(flag)  # the prompt cache's flags: taken, unused
    args = p.parse_args()
    if MODE == "boot_crash":
        print("ERROR fake: cannot start on cue", file=sys.stderr, flush=True)
        sys.exit(1)
    if MODE == "cued":
        exit_on_cue(os.environ["MLXD_FAKE_CUE"])
    print(f"fake: --batch {args.batch}", flush=True)  # what the supervisor asked for (its log shows it)
    app = web.Application()
    app["model_id"] = args.model_id
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/admin/drain", drain)
    if args.parent_pid:
        app.on_startup.append(lambda app: watch_parent(app, args.parent_pid))
    web.run_app(app, path=args.socket, print=None, handle_signals=True)


async def watch_parent(app: web.Application, parent: int) -> None:
    """Exit when the supervisor dies, as a real engine does (a SIGKILLed supervisor left this
    process running after test_a_stored_response_survives_a_sigkilled_supervisor)."""

    async def watch() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(0.2)  # a reparenting sends no event: polled, as the real engine does
        os._exit(0)

    app["parent_watch"] = asyncio.get_running_loop().create_task(watch())  # held: a task nobody holds can vanish


if __name__ == "__main__":
    main()
