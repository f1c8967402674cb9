"""A lane's step that raised (mlxd/engine/gpu/step_failure.py): in one engine its requests fail and
the engine serves on; in an engine group, or where the device's state is lost (`device_lost`, as
MLX raises it), it is raised on, so the engine ends and its replies go on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mlxd.engine.gpu.step_failure import device_lost, failed_code, failed_step
from mlxd.engine.spec import agreement


@pytest.fixture(autouse=True)
def _alone_after() -> Iterator[None]:
    yield
    agreement.alone()


def _raised() -> RuntimeError:
    try:
        raise RuntimeError("[ring] connection to a peer was lost")
    except RuntimeError as exc:
        return exc


def test_alone_a_failed_step_is_logged_and_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    agreement.alone()
    failed_step(_raised(), "batched step")
    assert "batched step failed (MLX memory: active" in caplog.text


@pytest.mark.parametrize("rank", ["leader", "follower"])
def test_in_a_group_a_failed_step_ends_the_engine(rank: str, caplog: pytest.LogCaptureFixture) -> None:
    if rank == "leader":
        agreement.lead(lambda value: None)
    else:
        agreement.follow(lambda: None)
    assert agreement.grouped()
    exc = _raised()
    with pytest.raises(RuntimeError, match="connection to a peer was lost") as raised:
        failed_step(exc, "generation")
    assert raised.value is exc
    assert "the ranks are out of step; the group ends" in caplog.text


class _Seq:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def fail(self, stats: object, message: str, *args: object) -> None:
        self.failed.append(message)


class _Lane:
    def admit(self, seq: object) -> None:
        raise _raised()

    pause = admit


class _Scheduler:
    def release(self, seq: object) -> None:
        pass

    remove = release


def _starts() -> list[tuple[str, object]]:
    """The places outside a step that run GPU work for one request: each fails the request alone
    in one engine, and in a group raises like a failed step."""
    from types import SimpleNamespace

    from mlxd.engine.gpu.batch_lane import BatchLane
    from mlxd.engine.gpu.runner import Runner

    owner = SimpleNamespace(_stats=None, scheduler=_Scheduler(), num_paused=0)
    return [
        ("batch lane start", lambda seq: BatchLane._guarded(owner, _Lane().admit, seq, [])),  # type: ignore[arg-type]
        ("runner start", lambda seq: Runner._start(owner, seq, _Lane())),  # type: ignore[arg-type]
        ("runner pause", lambda seq: Runner._pause(owner, seq, _Lane())),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("index", range(3))
def test_a_request_that_cannot_start_fails_alone_and_in_a_group_ends_the_engine(index: int) -> None:
    what, start = _starts()[index]
    agreement.alone()
    seq = _Seq()
    start(seq)  # type: ignore[operator]
    assert seq.failed and "connection to a peer was lost" in seq.failed[0], what
    agreement.lead(lambda value: None)
    seq = _Seq()
    with pytest.raises(RuntimeError, match="connection to a peer was lost"):
        start(seq)  # type: ignore[operator]
    assert seq.failed == [], what


LOST = [
    # an H100, 2026-12-07 (docs/benchmarks.md, issue 29): the step, then every later allocation
    "cudaLaunchKernelExC(&config, func, params) failed: an illegal memory access was encountered",
    "cudaMallocManaged(&data, size) failed: an illegal memory access was encountered",
    "cudaStreamSynchronize(stream) failed: unspecified launch failure",
    "cudaEventSynchronize(event) failed: device-side assert triggered",
    "[METAL] Command buffer execution failed: Caused GPU Hang Error (00000003:kIOGPUCommandBufferCallbackErrorHang)",
]
NOT_LOST = [
    "injected batch fault",
    "[metal::malloc] Attempting to allocate 68719476736 bytes which is greater than the maximum allowed "
    "buffer size of 28991029248 bytes.",
    "cudaMallocManaged(&data, size) failed: out of memory",
    "[concatenate] All the input array dimensions must match exactly except for the concatenation axis.",
]


@pytest.mark.parametrize("message", LOST)
def test_a_lost_device_ends_the_engine(message: str) -> None:
    assert device_lost(RuntimeError(message))
    agreement.alone()
    with pytest.raises(RuntimeError):
        failed_step(RuntimeError(message), "batched step")


@pytest.mark.parametrize("message", NOT_LOST)
def test_other_failures_fail_their_requests_alone(message: str) -> None:
    assert not device_lost(RuntimeError(message))


@pytest.mark.parametrize(("message", "code"), [
    ("cudaMallocAsync(&data, size, stream) failed: out of memory", "engine_out_of_memory"),
    ("cudaMallocManaged(&data, size) failed: out of memory", "engine_out_of_memory"),
    ("[metal::malloc] Attempting to allocate 68719476736 bytes which is greater than the maximum allowed "
     "buffer size of 28991029248 bytes.", "engine_out_of_memory"),
    ("injected batch fault", "generation_failed"),
    ("[concatenate] All the input array dimensions must match exactly except for the concatenation axis.",
     "generation_failed"),
])
def test_a_step_that_ran_out_of_memory_ends_its_rows_with_a_code_the_supervisor_goes_on_from(message: str, code: str) -> None:
    assert failed_code(RuntimeError(message)) == code
