"""Property-based fuzzing of a real supervisor from its own OpenAPI document (schemathesis).

Schemathesis turns mlxd/supervisor/http/openapi.py's document into Hypothesis strategies, valid
(positive) and invalid (negative) requests for every route, and each request goes to a real
`mlxd serve` with a real engine on the tiny random model. Every answer must be below 500, have
a documented status and content type, match its documented schema, and, when it is an error,
be JSON in OpenAI's shape. benchmarks/fuzz.py runs the same fuzzer for thousands of requests.

A sequential fuzzer with random model names would mostly see 404s, so a hook points some
requests at the real model (they load, unload, drain and lease it for real), feeds held lease
ids to the lease routes, and keeps leases short (1 s) so a machine lease can't stall the run.
"""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from mlxd.protocol.errors import ErrorBody
from mlxd.protocol.ollama_answers import OllamaError
from mlxd.supervisor.http.openapi import make_openapi
from mlxd.supervisor.relay.ollama_dialect import OLLAMA_PATHS
from tests.support import SupervisorProcess

KEY = "fuzz-key"
MODEL = "tiny"
EMBEDDER = "emb"  # the embedding routes' real model (an embedding engine under the fuzzer too)
EMBED_PATHS = ("/v1/embeddings", "/api/embed", "/api/embeddings")
LEASE_TTL_S = 1.0  # leases the fuzzer takes end by themselves this soon
REAL_MODEL_P = 0.3  # how often a request's `model` string is replaced with the real model
VALID_KEY_P = 0.9  # how often a request carries a valid key (else what schemathesis made up)
CALL_TIMEOUT_S = 20.0  # an answer slower than this is a hang
WEIGHTS = {"POST /v1/chat/completions": 5, "POST /v1/completions": 5}  # share of the mix (default: 2)
# Schemathesis' own server-error check is left out: problems() reports those with the body.
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance, negative_data_rejection]


def fuzz_config(model: Path, embedder: Path | None = None) -> str:
    """A supervisor with a key, one small-context model (short generations), an embedding model
    and short waits."""
    return (
        f'[server]\napi_keys = ["{KEY}"]\nmax_body_bytes = 262144\n\n'
        "[pool]\nqueue_timeout_s = 12\ndrain_timeout_s = 5\n\n"
        f'[models.{MODEL}]\npath = "{model}"\nmax_context = 128\n'
        + (f'[models.{EMBEDDER}]\npath = "{embedder}"\n' if embedder is not None else "")
    )


@dataclass
class Finding:
    """A request the server answered wrongly (or not at all), with a command that repeats it."""

    route: str
    status: int | str
    problem: str
    repro: str


@dataclass
class Tally:
    """Status counts per route, and what went wrong."""

    statuses: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    findings: list[Finding] = field(default_factory=list)
    num_sent: int = 0
    stalled: bool = False  # a request timed out, or waited out the queue: the rest were not sent

    def num_server_errors(self) -> int:
        """Answers of 500 or more, and requests that got no answer."""
        return sum(n for counts in self.statuses.values() for status, n in counts.items()
                   if not status.isdigit() or int(status) >= 500)


class Fuzzer:
    """Sends schemathesis cases to a supervisor and checks each answer."""

    def __init__(self, url: str, model: str = MODEL, key: str = KEY, checks: list[Any] | None = None) -> None:
        self.url, self.model, self.key = url, model, key
        self.checks = CHECKS if checks is None else checks
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()
        self.held: dict[str, float] = {}  # lease id -> when it expires (monotonic)
        self._lease_picks: dict[int, float] = {}  # id(case) -> where in the held leases it points
        self.tally = Tally()
        self.schema = schemathesis.openapi.from_dict(make_openapi())
        self.schema.config.output.sanitization.enabled = False  # repros keep `max_tokens` and the test key
        self.schema.hook(self._flatmap_case())

    def _flatmap_case(self) -> Any:
        fuzzer = self

        def flatmap_case(context: Any, case: Case) -> st.SearchStrategy[Case]:
            return st.randoms(use_true_random=False).map(functools.partial(fuzzer.steer, case))

        return flatmap_case

    def steer(self, case: Case, rnd: random.Random) -> Case:
        """Point some requests at the real model and held leases; keep leases short; add keys."""
        # A fixed number of draws whatever the state (Hypothesis insists on that).
        real_model, upper, held_lease, pick, valid_key, bearer = (rnd.random() for _ in range(6))
        if isinstance(case.body, dict):
            body = dict(case.body)
            if isinstance(body.get("model"), str) and real_model < REAL_MODEL_P:
                model = EMBEDDER if case.operation.path in EMBED_PATHS else self.model
                body["model"] = model.upper() if upper < 0.2 else model
            ttl = body.get("ttl_s", LEASE_TTL_S if case.operation.label == "POST /admin/leases" else None)
            if type(ttl) in (int, float) and ttl <= 7 * 24 * 3600:
                body["ttl_s"] = min(ttl, LEASE_TTL_S)
            case.body = body
        # Which held lease it names is known only when it is sent (every case passes here, so
        # an entry left by a case Hypothesis threw away is overwritten, never reused).
        names_lease = "lease_id" in (case.path_parameters or {}) and held_lease < 0.5
        self._lease_picks[id(case)] = pick if names_lease else None
        # A case whose headers were made invalid keeps them: with a good key put back, the server
        # rightly accepts it, and schemathesis (which still sees the broken headers) reports a
        # violating request accepted, whenever nothing else turned the request away.
        negative_headers = case.meta is not None and case.meta.is_negative_at(ParameterLocation.HEADER)
        if valid_key < VALID_KEY_P and not negative_headers:
            for name in ("Authorization", "x-api-key"):
                case.headers.pop(name, None)
            case.headers["Authorization" if bearer < 0.5 else "x-api-key"] = (
                f"Bearer {self.key}" if bearer < 0.5 else self.key)
        return case

    def strategies(self) -> dict[str, st.SearchStrategy[Case]]:
        """Valid and invalid requests, per route."""
        ops = [result.ok() for result in self.schema.get_all_operations()]
        return {op.label: st.one_of([op.as_strategy(mode) for mode in GenerationMode]) for op in ops}

    def mixed(self) -> st.SearchStrategy[Case]:
        """Requests for any route, more for the inference routes (their bodies vary most)."""
        # Distinct strategy objects: Hypothesis draws repeats of one object no more often.
        draws = [self.strategies() for _ in range(max(WEIGHTS.values()))]
        return st.one_of([d[label] for label in draws[0] for d in draws[:WEIGHTS.get(label, 2)]])

    def run(self, num_examples: int, seed: int, concurrency: int = 1, per_route: int = 3) -> Tally:
        """Send `per_route` generated requests to every route, then about `num_examples` in all
        (Hypothesis decides the exact count) for routes mixed at random, up to `concurrency` at
        once so that admin calls land while requests are in flight."""
        # Every case is made before the first is sent. Hypothesis reads sys.modules while it
        # makes cases (to describe lambdas) and fails when another thread imports meanwhile, as
        # a sending thread does the first time it meets some answer ("dictionary changed size
        # during iteration", seen in CI).
        strategies = self.strategies()
        cases: list[Case] = []
        for strategy in strategies.values():
            generate(strategy, cases.append, per_route, seed)
        generate(self.mixed(), cases.append, max(1, num_examples - per_route * len(strategies)), seed)
        with ThreadPoolExecutor(concurrency) as pool:
            slots = threading.BoundedSemaphore(concurrency)
            for case in cases:
                slots.acquire()
                pool.submit(self.send, case).add_done_callback(lambda _: slots.release())
        return self.tally

    def send(self, case: Case) -> None:
        """One request: count its status, note what is wrong with the answer."""
        route = case.operation.label
        if self.tally.stalled:
            return  # a stuck server would make every later request wait out its timeout
        with self._lock:
            ids = [i for i, end in self.held.items() if end > time.monotonic()] or list(self.held)
        pick = self._lease_picks.pop(id(case), None)
        if pick is not None and ids:
            case.path_parameters = {**case.path_parameters, "lease_id": ids[int(pick * len(ids))]}
        try:
            response = case.call(base_url=self.url, session=self._session(), timeout=CALL_TIMEOUT_S)
        except requests.RequestException as exc:
            self.tally.stalled |= isinstance(exc, requests.Timeout)
            self._record(route, type(exc).__name__, [str(exc)[:300]], case)
            return
        self.tally.stalled |= response.status_code == 503 and b"queue_timeout" in response.content
        self._track_leases(route, response)
        self._record(route, response.status_code, list(self.problems(case, response)), case)

    def _session(self) -> requests.Session:
        """One keep-alive session per sending thread (a Session is not thread-safe)."""
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            self._sessions.append(session)
        return session

    def _record(self, route: str, status: int | str, problems: list[str], case: Case) -> None:
        with self._lock:
            self.tally.num_sent += 1
            self.tally.statuses[route][str(status)] += 1
            self.tally.findings.extend(Finding(route, status, p, _curl(case)) for p in problems)

    def close(self) -> None:
        for session in self._sessions:
            session.close()

    def problems(self, case: Case, response: requests.Response) -> Iterator[str]:
        """What is wrong with this answer: a server error, schemathesis' checks, the error format."""
        if response.status_code >= 500:
            yield f"server error: {response.content[:300]!r}"
        try:
            case.validate_response(response, checks=self.checks)
        except FailureGroup as group:
            yield from (f"{f.title}: {f.message}"[:1000] for f in group.exceptions)
        except Failure as failure:
            yield f"{failure.title}: {failure.message}"[:1000]
        if response.status_code >= 400:
            shape, name = (OllamaError, "Ollama's") if case.path in OLLAMA_PATHS else (ErrorBody, "OpenAI's")
            try:
                msgspec.json.decode(response.content, type=shape)
            except msgspec.DecodeError:
                yield f"error body is not {name} error JSON: {response.content[:200]!r}"
        elif response.headers.get("Content-Type", "").startswith("text/event-stream"):
            yield from _stream_problems(response.text)
        elif response.headers.get("Content-Type", "").startswith("application/x-ndjson"):
            yield from _ndjson_problems(response.text)

    def _track_leases(self, route: str, response: requests.Response) -> None:
        """Remember the leases taken, so that renew and delete can name them."""
        with self._lock:
            if route == "POST /admin/leases" and response.status_code == 200:
                lease = response.json()
                self.held[lease["id"]] = time.monotonic() + float(lease["ttl_s"])
            elif route == "DELETE /admin/leases/{lease_id}" and response.status_code == 200:
                self.held.pop(response.json()["id"], None)


def generate(strategy: st.SearchStrategy[Case], use: Callable[[Case], None], num_examples: int, seed: int) -> None:
    """Call `use` on about `num_examples` cases: generation only (nothing to shrink: findings
    are collected, not raised), no example database."""

    @settings(max_examples=num_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @hypothesis_seed(seed)
    @given(strategy)
    def each(case: Case) -> None:
        use(case)

    each()


def _stream_problems(text: str) -> Iterator[str]:
    """An SSE answer ends with `data: [DONE]`; an error event in it is a failure mid-stream."""
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    for event in events:
        try:
            payload = json.loads(event) if event != "[DONE]" else {}
        except ValueError:
            payload = {"error": "not JSON"}
        if "error" in payload:
            yield f"error event in the stream: {event[:300]}"
    if not events or events[-1] != "[DONE]":
        yield f"stream does not end with [DONE]: {text[-200:]!r}"


def _ndjson_problems(text: str) -> Iterator[str]:
    """An Ollama stream is JSON lines, the last with `done: true`; an error line is a failure."""
    try:
        lines = [json.loads(line) for line in text.splitlines() if line]
    except ValueError:
        yield f"a stream line is not JSON: {text[:200]!r}"
        return
    if any("error" in line for line in lines):
        yield f"error line in the stream: {text[-300:]!r}"
    elif not lines or lines[-1].get("done") is not True:
        yield f"stream does not end with done: {text[-200:]!r}"


def _curl(case: Case) -> str:
    try:
        return case.as_curl_command()
    except Exception as exc:  # a case curl can't express is still worth reporting
        return f"(no curl: {exc}) {case!r}"


@pytest.fixture(scope="module")
def sup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    from mlxd.engine.models.random_embedder import build_random_bert

    embedder = build_random_bert(tmp_path_factory.mktemp("fuzz-emb") / "emb", pooling="mean")
    data = tmp_path_factory.mktemp("fuzz")
    # The machine's bandwidth, measured as the supervisor would on its first GET /library, which
    # waits for it up to a minute: under load that passed the fuzzer's hang timeout (20 s).
    subprocess.run([sys.executable, "-m", "mlxd.engine.bandwidth", "--out", str(data / "probe" / "bandwidth.json")],
                   check=True, capture_output=True, timeout=240)
    # Offline: a fuzzed /api/pull answers from the (empty) hub cache instead of reaching for the hub.
    proc = SupervisorProcess(fuzz_config(tiny_model, embedder), data, env={"HF_HUB_OFFLINE": "1"}).wait_up()
    yield proc
    proc.stop()


def report(tally: Tally) -> str:
    """The first findings, each with a command that repeats it."""
    return "\n\n".join(f"{f.route} -> {f.status}: {f.problem}\n  {f.repro}" for f in tally.findings[:10])


def test_fuzzing_every_route_finds_no_server_error_and_no_undocumented_answer(sup: SupervisorProcess) -> None:
    fuzzer = Fuzzer(sup.url)
    try:
        tally = fuzzer.run(num_examples=200, seed=1)  # 300 took 24 s: `make test` stays under 10 minutes
    finally:
        fuzzer.close()
    assert tally.num_server_errors() == 0, report(tally)
    assert not tally.findings, report(tally)
    assert tally.num_sent >= 170
    assert len(tally.statuses) == len(list(fuzzer.schema.get_all_operations())), tally.statuses


# With requests in flight, schemathesis' record of how a negative case was mutated was once
# seen not to match the body sent (a 3000-request run: the listed violations each get a 400
# alone): that check runs in the sequential test only.
IN_FLIGHT_CHECKS = [c for c in CHECKS if c is not negative_data_rejection]


def test_fuzzing_with_requests_in_flight_finds_no_server_error_and_no_hang(sup: SupervisorProcess) -> None:
    fuzzer = Fuzzer(sup.url, checks=IN_FLIGHT_CHECKS)
    try:
        tally = fuzzer.run(num_examples=300, seed=2, concurrency=3)
    finally:
        fuzzer.close()
    assert tally.num_server_errors() == 0, report(tally)
    assert not tally.findings, report(tally)
    assert tally.num_sent >= 250
