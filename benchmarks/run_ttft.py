"""What `mlxd run` adds to the time to first token: Enter to the first answer token on screen.

A real `mlxd serve` runs SmolLM2-135M-Instruct (or --model). `mlxd run` runs at its prompt in a
pseudo-terminal (pexpect). Round after round, alternating, the same greedy request goes:

  mlxd run  `/clear`, type the question, then time from Enter to the first token of the
            answer appearing in the terminal's output (its text, escape sequences aside)
  curl      `curl -sN` of the same body to /v1/chat/completions, timed from starting curl to
            the first SSE event whose delta has content (curl's own start-up included; a
            whole `curl URL/health` is timed too, to show what that start-up costs)

and the figures are the medians over the rounds, their difference and ratio. The model is
warm (one request first) and the prompt is the same each round, so both hit the same prompt
cache.

  python benchmarks/run_ttft.py [--rounds 40] [--model PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pexpect

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import SupervisorProcess  # noqa: E402  (after the sys.path line)

QUESTION = "What is the capital of France?"
MAX_TOKENS = 8
CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")


def body(model: str) -> dict[str, Any]:
    """The request both sides send (mlxd run's, with /set parameter temperature 0 and max_tokens)."""
    return {"model": model, "messages": [{"role": "user", "content": QUESTION}], "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, "max_tokens": MAX_TOKENS}


def first_content(url: str, model: str) -> str:
    """The greedy answer's first piece of content (what to look for on screen)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body(model)), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    for line in resp:
        if line.startswith(b"data: {") and (text := content_of(line)):
            conn.close()
            return text
    raise RuntimeError("no content in the answer")


def content_of(line: bytes) -> str:
    """The content of an SSE data line's delta ("" for none)."""
    chunk = json.loads(line[6:])
    choices = chunk.get("choices") or [{}]
    return str(choices[0].get("delta", {}).get("content") or "")


def curl_ttft(url: str, model: str) -> float:
    """Seconds from starting curl to its first SSE event with content."""
    argv = ["curl", "-sN", "-H", "Content-Type: application/json", "-d", json.dumps(body(model)),
            f"{url}/v1/chat/completions"]
    t0 = time.perf_counter()
    with subprocess.Popen(argv, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(b"data: {") and content_of(line):
                elapsed = time.perf_counter() - t0
                break
        else:
            raise RuntimeError("curl saw no content")
        proc.stdout.read()
    return elapsed


def curl_baseline(url: str) -> float:
    """Seconds for a whole `curl -s URL/health`: curl's own start-up and exit, near enough."""
    t0 = time.perf_counter()
    subprocess.run(["curl", "-s", "-o", os.devnull, f"{url}/health"], check=True)
    return time.perf_counter() - t0


class RunPrompt:
    """`mlxd run` at its prompt, greedy, short answers."""

    def __init__(self, url: str, model: str) -> None:
        argv = ["-m", "mlxd", "run", "--url", url, model, "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
        # A terminal answers prompt_toolkit's cursor position requests; pexpect does not, and an
        # unanswered one holds the prompt up to 1 s after Enter. So none are sent.
        env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"}
        self.child = pexpect.spawn(sys.executable, argv, env=env, encoding="utf-8", timeout=60, dimensions=(50, 200))
        self.child.delaybeforesend = None  # pexpect sleeps 50 ms before each send otherwise
        self.child.expect_exact(">>>")

    def ttft(self, first: str) -> float:
        """Seconds from Enter to `first` on screen, for a fresh conversation."""
        self.child.sendline("/clear")
        self.child.expect_exact("Cleared the conversation.")
        self.child.expect_exact(">>>")
        self.child.send(QUESTION)
        self.child.expect_exact(QUESTION)  # echoed: the line is typed
        t0 = time.perf_counter()
        self.child.send("\r")
        seen = ""
        while True:
            if time.perf_counter() - t0 > 60:
                raise RuntimeError(f"{first!r} not seen on screen: {CSI.sub('', seen)[-300:]!r}")
            with contextlib.suppress(pexpect.TIMEOUT):
                seen += self.child.read_nonblocking(4096, timeout=5)
            if first in CSI.sub("", seen).rsplit(QUESTION, 1)[-1]:
                elapsed = time.perf_counter() - t0
                break
        while not re.search(r"first token.*>>>", CSI.sub("", seen), re.DOTALL):  # the stats, then the prompt
            with contextlib.suppress(pexpect.TIMEOUT):
                seen += self.child.read_nonblocking(4096, timeout=5)
        return elapsed

    def close(self) -> None:
        self.child.sendline("/bye")
        self.child.expect(pexpect.EOF)
        self.child.close()


def default_model(work: Path) -> Path:
    """SmolLM2-135M-Instruct, imported into `work`."""
    from mlxd.engine.models.importer import import_default

    return import_default(work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--model", type=Path, help="an MLX model dir (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    if shutil.which("curl") is None:
        sys.exit("needs curl")
    with tempfile.TemporaryDirectory(prefix="mlxd-run-ttft-") as tmp:
        model = args.model or default_model(Path(tmp) / "models")
        sup = SupervisorProcess(f'[models.m]\npath = "{model}"\n', Path(tmp) / "sup").wait_up()
        try:
            measure(sup.url, args.rounds)
        finally:
            sup.stop()


def measure(url: str, rounds: int, model: str = "m") -> None:
    first = first_content(url, model)  # also warms the model
    run = RunPrompt(url, model)
    run_s: list[float] = []
    curl_s: list[float] = []
    try:
        for i in range(rounds):
            pair = [lambda: run_s.append(run.ttft(first)), lambda: curl_s.append(curl_ttft(url, model))]
            for step in pair if i % 2 == 0 else reversed(pair):
                step()
    finally:
        run.close()
    base_s = statistics.median(curl_baseline(url) for _ in range(rounds))
    med_run, med_curl = statistics.median(run_s) * 1000, statistics.median(curl_s) * 1000
    print(f"first content token {first!r}, {rounds} rounds, alternating")
    print(f"mlxd run  (Enter -> first token on screen): median {med_run:7.1f} ms  "
          f"(min {min(run_s) * 1000:.1f}, max {max(run_s) * 1000:.1f})")
    print(f"curl -N   (start -> first content event):   median {med_curl:7.1f} ms  "
          f"(min {min(curl_s) * 1000:.1f}, max {max(curl_s) * 1000:.1f})")
    print(f"difference {med_run - med_curl:+.1f} ms, ratio {med_run / med_curl:.2f}")
    print(f"(a whole `curl -s {url}/health` takes {base_s * 1000:.1f} ms (median): curl's own start-up is in its figure)")


if __name__ == "__main__":
    main()
