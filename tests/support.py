"""Start and talk to real engine processes in tests."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import psutil

try:
    import httpx2 as httpx
except ImportError:  # a bare GPU machine running a benchmark has httpx, which httpx2 forked
    import httpx  # type: ignore[no-redef]

from mlxd.protocol.process import SPARE_FLAG

if TYPE_CHECKING:  # the SDKs are imported where used: benchmarks on a bare GPU machine lack them
    import anthropic
    import openai

# The tiny random model's EOS (<|im_end|>), biased away so sampled requests always reach max_tokens.
NO_EOS = {"2": -100}
# The real engine with faults on cue (tests/integration/faulty_engine.py); run it with MLXD_BLAS=off.
FAULTY_ENGINE = [sys.executable, str(Path(__file__).parent / "integration" / "faulty_engine.py")]


T = TypeVar("T")


def wait_for(probe: Callable[[], T], timeout: float = 5.0, *, interval: float = 0.01,
             message: str | Callable[[], str] | None = None) -> T:
    """Poll `probe` every `interval` s until its answer is truthy or `timeout` passes; its last
    answer. With `message` (a callable is called at the timeout, e.g. for a log), a timeout
    fails the test with it instead of returning the falsy answer."""
    deadline = time.monotonic() + timeout
    while not (value := probe()) and time.monotonic() < deadline:
        time.sleep(interval)
    if not value and message is not None:
        raise AssertionError(message() if callable(message) else message)
    return value


async def wait_for_async(probe: Callable[[], T], timeout: float = 5.0, *, interval: float = 0.01,
                         message: str | Callable[[], str] | None = None) -> T:
    """wait_for on an event loop: the loop runs between polls."""
    deadline = time.monotonic() + timeout
    while not (value := probe()) and time.monotonic() < deadline:
        await asyncio.sleep(interval)
    if not value and message is not None:
        raise AssertionError(message() if callable(message) else message)
    return value


def private_socket_dir() -> Path:
    """A short 0700 dir under /tmp (socket paths must stay under ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="mx-", dir="/tmp"))
    path.chmod(0o700)
    return path


def terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; reap it either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def is_listening(path: Path) -> bool:
    """Whether a Unix socket accepts connections (httpx leaks a socket on a refused connect)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


ENGINE = [sys.executable, "-m", "mlxd.engine"]
SPARE_IGNORES = {"PYTEST_CURRENT_TEST"}  # set anew for every test; nothing in the engine reads it


def engine_log_path() -> Path:
    """Where an engine's output goes: a fresh dir of its own (beside it: its SSD tier and data)."""
    return Path(tempfile.mkdtemp(prefix="mx-log-")) / "engine.log"


def launch(argv: list[str], log_path: Path, env: dict[str, str] | None, stdin: int | None = None,
           ) -> tuple[subprocess.Popen[bytes], Any]:
    """Start an engine process writing to `log_path`, with its own data dir (the width probe's memo)."""
    env = dict(os.environ) if env is None else env
    env.setdefault("MLXD_DATA_DIR", str(log_path.parent / "data"))
    log = log_path.open("wb")
    return subprocess.Popen(argv, stdin=stdin, stdout=log, stderr=subprocess.STDOUT, env=env), log


class Spares:
    """Engines with their imports done (`python -m mlxd.engine --spare`, as the supervisor keeps
    one), so that a test's engine costs its load, not the ~2 s of importing mlx-lm again: one
    is kept ready per test process, started when the last one was taken. A test that gives
    its engine an environment or a launcher of its own, or changed os.environ since the spare
    started, gets a fresh process as before."""

    def __init__(self) -> None:
        self._ready: tuple[subprocess.Popen[bytes], Any, Path, dict[str, str]] | None = None

    def take(self, flags: Callable[[Path], list[str]]) -> tuple[subprocess.Popen[bytes], Any, Path] | None:
        """A spare given the engine's flags (`flags` of the dir its log is in), and its log file
        and path; None when none fits."""
        spare, self._ready = self._ready, None
        self._start()
        if spare is None:
            return None
        proc, log, log_path, env = spare
        if proc.poll() is not None or env != self._environ():
            self._discard(proc, log)
            return None
        assert proc.stdin is not None
        try:
            proc.stdin.write((json.dumps(flags(log_path.parent)) + "\n").encode())
            proc.stdin.close()  # it reads one line
        except OSError:  # it died just now
            self._discard(proc, log)
            return None
        return proc, log, log_path

    def _start(self) -> None:
        log_path = engine_log_path()
        proc, log = launch([*ENGINE, SPARE_FLAG], log_path, None, stdin=subprocess.PIPE)
        self._ready = (proc, log, log_path, self._environ())

    @staticmethod
    def _environ() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k not in SPARE_IGNORES}

    @staticmethod
    def _discard(proc: subprocess.Popen[bytes], log: Any) -> None:
        proc.kill()
        proc.wait()
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        log.close()

    def close(self) -> None:
        spare, self._ready = self._ready, None
        if spare is not None:
            self._discard(spare[0], spare[1])


SPARES = Spares()
atexit.register(SPARES.close)


class EngineProcess:
    """A real `python -m mlxd.engine` child with its socket, log, and an httpx client (a spare
    from SPARES when the test asks for the plain engine in the test process's environment)."""

    def __init__(
        self, model: Path, model_id: str, *extra: str, env: dict[str, str] | None = None,
        launcher: list[str] | None = None, socket_dir: Path | None = None,
    ) -> None:
        self.dir = socket_dir or private_socket_dir()
        self.socket = self.dir / "e.sock"
        def flags(beside: Path) -> list[str]:
            return self._flags(model, model_id, extra, beside)

        spare = SPARES.take(flags) if launcher is None and env is None else None
        if spare is not None:
            self.proc, self._log, self.log_path = spare
        else:
            self.log_path = engine_log_path()
            argv = [*(launcher or ENGINE), *flags(self.log_path.parent)]
            self.proc, self._log = launch(argv, self.log_path, env)
        self.client = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://engine", timeout=120)

    def _flags(self, model: Path, model_id: str, extra: tuple[str, ...], beside: Path) -> list[str]:
        if "--ssd-cache-dir" not in extra:  # each engine its own SSD tier unless a test shares one
            extra = (*extra, "--ssd-cache-dir", str(beside / "kv"))
        return ["--model", str(model), "--model-id", model_id, "--socket", str(self.socket), *extra]

    def wait_ready(self, timeout: float = 60.0) -> EngineProcess:
        """Block until /health says ready; raise with the engine's log if it dies first."""
        wait_for(self._is_ready, timeout, interval=0.05, message=lambda: f"engine not ready in {timeout}s:\n{self.log()}")
        return self

    def _is_ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log()}")
        # It may go away mid-check (an engine failing its load exits): the next poll sees it. httpx
        # then leaks the socket of the connect it refused; that is let go here, not as a
        # ResourceWarning wherever the collector happens to run (it failed a test once).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            try:
                return is_listening(self.socket) and self.client.get("/health").json().get("status") == "ready"
            except httpx.TransportError:
                gc.collect()
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stats(self) -> dict[str, Any]:
        return checked_stats(self.client.get("/admin/stats").content)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 10 s; return the exit code."""
        terminate(self.proc, 10)
        self.client.close()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_engine(model: Path, model_id: str, *extra: str, env: dict[str, str] | None = None) -> Iterator[EngineProcess]:
    """An engine that is ready, stopped on exit."""
    engine = EngineProcess(model, model_id, *extra, env=env)
    try:
        yield engine.wait_ready()
    finally:
        engine.stop()


def default_sigint() -> None:
    """A child's preexec_fn for the tests that press Ctrl-C: SIGINT does what it does in a
    terminal, even when the suite itself was started with SIGINT ignored (a shell starts a
    background job so, and children inherit it: then the Ctrl-C tests saw nothing stop)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def engine_client(engine: EngineProcess) -> httpx.Client:
    """A client of the engine's socket of its own (one per thread)."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(engine.socket)), base_url="http://engine", timeout=120)


def complete(engine: EngineProcess, prompt: str, **body: Any) -> dict[str, Any]:
    """A greedy completion of up to 24 tokens straight from the engine: its JSON and `status`."""
    with engine_client(engine) as c:
        resp = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0, **body})
        return {"status": resp.status_code, **resp.json()}


def text_of(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["text"])


def at_once(engine: EngineProcess, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bodies sent together (each a `complete` keyword set with a `prompt`)."""
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: complete(engine, **b), bodies))


def lanes(engine: EngineProcess) -> dict[str, Any]:
    """The engine's lanes from /admin/stats."""
    return dict(engine.stats()["lanes"])


@contextlib.contextmanager
def openai_client(engine: EngineProcess) -> Iterator[openai.OpenAI]:
    """The official OpenAI SDK, talking to `engine` over its Unix socket."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(engine.socket))) as http:
        import openai

        yield openai.OpenAI(base_url="http://engine/v1", api_key="unused", http_client=http, max_retries=0)


def engine_env(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`."""
    env = dict(os.environ)
    env.update(extra)
    return env


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def port_open(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:port."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SupervisorProcess:
    """A real `mlxd serve` on a free port, with a private runtime dir and data dir."""

    def __init__(
        self, config_toml: str, data_dir: Path, *extra: str, env: dict[str, str] | None = None,
        runtime: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.runtime = runtime or private_socket_dir()
        self.config = data_dir / "config.toml"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(config_toml)
        self.log_path = data_dir / "supervisor.log"
        self._log = self.log_path.open("wb")
        # No spare engine unless a test asks: its imports would cost every test ~2 s of CPU.
        env = engine_env(MLXD_RUNTIME_DIR=str(self.runtime), **{"MLXD_SPARE_ENGINE": "0", **(env or {})})
        argv = [sys.executable, "-m", "mlxd", "serve", "--port", str(self.port), "--config", str(self.config),
                "--data-dir", str(data_dir), *extra]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=120)
        self._sdk_clients: list[openai.OpenAI | anthropic.Anthropic] = []

    def wait_up(self, timeout: float = 30.0) -> SupervisorProcess:
        wait_for(self._is_up, timeout, interval=0.05, message=lambda: f"supervisor not up in {timeout}s:\n{self.log()}")
        return self

    def _is_up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"supervisor exited with {self.proc.returncode}:\n{self.log()}")
        return port_open(self.port) and self.client.get("/health").status_code == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_stats(self, model_id: str) -> dict[str, Any]:
        """The model's engine's own /admin/stats, straight over its socket."""
        from mlxd.supervisor.engines.engine import socket_path

        path = socket_path(self.runtime, model_id)
        if not is_listening(path):  # asked anyway, httpx would leak the socket of the failed connect
            raise AssertionError(f"no engine listens for {model_id} at {path}")
        transport = httpx.HTTPTransport(uds=str(path))
        with httpx.Client(transport=transport, base_url="http://engine") as client:
            return checked_stats(client.get("/admin/stats").content)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        """An SDK client on the supervisor; closed by stop() (an unclosed one leaks its sockets)."""
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)
        self._sdk_clients.append(client)
        return client

    def anthropic(self, api_key: str = "unused") -> anthropic.Anthropic:
        """The anthropic SDK on the supervisor; closed by stop()."""
        import anthropic

        client = anthropic.Anthropic(base_url=self.url, api_key=api_key, max_retries=0)
        self._sdk_clients.append(client)
        return client

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 30 s; return the exit code."""
        terminate(self.proc, 30)
        self.client.close()
        for client in self._sdk_clients:
            client.close()
        self._log.close()
        return self.proc.returncode


def checked_stats(body: bytes) -> dict[str, Any]:
    """An engine's /admin/stats body as a dict, once it decodes as the protocol's EngineStats
    (strictly: every read of the stats in the tests checks the contract the supervisor reads)."""
    from mlxd.protocol.stats import EngineStats

    msgspec.json.decode(body, type=EngineStats)
    return dict(msgspec.json.decode(body))


# A Qwen3-style chat template for SmolLM2: its generation prompt opens a think block, so the
# reply is reasoning (test_reasoning.py, test_thinking_apis.py).
THINKING_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def model_with_template(model: Path, dest: Path, template: str) -> Path:
    """`model`'s files linked into `dest`, but for its tokenizer config, which gets `template`
    as its chat template."""
    import json

    dest.mkdir(parents=True)
    for f in model.iterdir():
        if f.name != "tokenizer_config.json":
            (dest / f.name).symlink_to(f)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def http10_post(port: int, path: str, body: bytes, *headers: bytes) -> tuple[bytes, bytes]:
    """POST `body` over HTTP/1.0 (no chunked encoding: the answer runs to the close); the
    answer's head and body."""
    lines = b"".join(h + b"\r\n" for h in headers)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"POST %b HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%b"
                     b"Content-Length: %d\r\n\r\n%b" % (path.encode(), lines, len(body), body))
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    return head, payload


def cli_env(**extra: str) -> dict[str, str]:
    """This environment without any mlxd address or key, plus `extra`."""
    drop = {"MLXD_URL", "MLXD_ADMIN_KEY", "MLXD_API_KEY", "MLXD_CONFIG", "MLXD_HOST", "MLXD_PORT"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def mlxd(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
         input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m mlxd ARGS` to completion (`input_text` on its stdin)."""
    argv = [sys.executable, "-m", "mlxd", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env or cli_env(), timeout=timeout, check=False,
                          input=input_text)


@contextlib.contextmanager
def serving(model: Path, model_id: str, data_dir: Path, *args: str, model_config: str = "",
            env: dict[str, str] | None = None) -> Iterator[SupervisorProcess]:
    """A supervisor serving `model` alone as `model_id` (a `[models.ID]` entry, with
    `model_config`'s lines), up until the block ends; `args` go to `mlxd serve`."""
    proc = SupervisorProcess(f'[models.{model_id}]\npath = "{model}"\n{model_config}', data_dir, *args, env=env)
    try:
        yield proc.wait_up()
    finally:
        proc.stop()


HEAD_TIMEOUT_S = 1.0
# A supervisor's [server] table with every guard tight (test_hardening.py, test_browser.py).
HARDENED_CONFIG = f"""[server]
head_timeout_s = {HEAD_TIMEOUT_S}
keepalive_timeout_s = 2
max_connections = 40
max_connections_per_peer = 30
stream_keepalive_s = 0.2
allowed_hosts = ["mlxd.lan", "*.example.org"]
allowed_origins = ["http://app.example.com", "http://localhost:*"]
"""
# The fake engine (tests/fake_engine.py) behind a real supervisor, restarted and health-checked quickly.
FAKE_ENGINE_ENV = {"MLXD_ENGINE_MODULE": "tests.fake_engine", "MLXD_ENGINE_BACKOFF_S": "0.05",
                   "MLXD_ENGINE_HEALTH_EVERY_S": "0.2", "MLXD_ENGINE_HEALTH_DEADLINE_S": "1",
                   "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def fake_supervisor(root: Path, mode: str = "ok", model_config: str = "", *, config: str = "",
                    **env: str) -> SupervisorProcess:
    """A supervisor, up, serving model `fake` on the fake engine in `mode` (MLXD_FAKE_MODE);
    `config` goes before the `[models.fake]` table, `model_config` after its path."""
    model = root / "fake-model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    toml = f'{config}\n[models.fake]\npath = "{model}"\n{model_config}'
    return SupervisorProcess(toml, root / "data", env={**FAKE_ENGINE_ENV, "MLXD_FAKE_MODE": mode, **env}).wait_up()


def hold_until(engine: EngineProcess, leave: threading.Event, ready: threading.Event,
               bias: dict[str, float] | None = None) -> None:
    """A long text stream that books nearly all of a small KV budget (EOS biased away: NO_EOS,
    the tiny model's, unless `bias`); it sets `ready` once it streams, and its client leaves on
    `leave` (leaving the block drops the connection: the engine frees its row)."""
    budget = lanes(engine)["kv_budget_tokens"]
    body = {"prompt": "x", "max_tokens": budget - 4, "temperature": 0, "logit_bias": bias or NO_EOS, "stream": True}
    with engine_client(engine) as c, c.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                ready.set()
            if leave.is_set():
                return


def start_in_one_turn(engine: EngineProcess, calls: list[Callable[[], T]],
                      bias: dict[str, float] | None = None) -> list[concurrent.futures.Future[T]]:
    """Make `calls` (requests to `engine`) start in one turn: sent while a blocker (hold_until)
    holds the KV budget; once all of them wait, the blocker leaves. Their futures."""
    leave, ready = threading.Event(), threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(len(calls) + 1)
    pool.submit(hold_until, engine, leave, ready, bias)
    assert ready.wait(60), engine.log()
    held = lanes(engine)
    # A blocker that leaves room lets the calls start as they come, one turn each: the engine's
    # budget must be under its context window (--kv-budget-tokens), which clamps max_tokens.
    assert held["kv_budget_tokens"] - held["kv_booked_tokens"] < 64, f"the blocker left KV free: {held}"
    futures = [pool.submit(call) for call in calls]
    wait_for(lambda: lanes(engine)["waiting"] == len(calls), 60, message=lambda: str(lanes(engine)))
    leave.set()
    pool.shutdown(wait=False)
    return futures


def fake_weights(path: Path, tensors: dict[str, int], layers: int = 4) -> Path:
    """A model dir whose safetensors header names `tensors` (name: bytes); config with `layers`."""
    path.mkdir(exist_ok=True)
    offset, header = 0, {}
    for name, size in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [size // 2], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": 64,
                                                  "num_attention_heads": 4, "num_key_value_heads": 2}))
    return path
