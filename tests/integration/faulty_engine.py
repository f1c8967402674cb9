"""The real engine, with faults on cue, chosen by words in the prompt:

- RAISE: that request's own token handling raises after 3 tokens (in either lane): only it fails.
- BATCHFAIL: the batched step raises once, when the row holding it has 3 tokens and the batch
  lane holds 3 rows: every row in the batch lane fails, and the engine goes on serving.
- DEVICELOST: as BATCHFAIL, but the step raises what MLX's CUDA backend raises after an illegal
  memory access (the device's state is lost): the engine ends, its rows cut short.
- OOMFAIL: as BATCHFAIL, but the step raises what MLX's CUDA allocator raises when the card's
  memory ran out, once in the process (the reply going on is not marked again): the rows end
  `engine_out_of_memory`, which the supervisor goes on from.
- SLOWPREFILL: each chunk of a shared prefill whose first member asks for it takes 0.3 s more,
  so a test can act while it runs; in the serial lane, each prefill chunk of the request.

Run as a script with MLXD_BLAS=off (the OpenBLAS re-exec would drop these patches).
"""

from __future__ import annotations

import time
from typing import Any

from mlxd.engine.__main__ import main
from mlxd.engine.gpu import batch_lane, gateway, sequence, serial_lane

real_submit = gateway.Gateway.submit
real_add = sequence.Sequence.add
real_step = batch_lane.BatchLane.step
real_prefill_groups = batch_lane.BatchLane._prefill_groups
real_serial_chunk = serial_lane.SerialLane._prefill_chunk
SLOW_CHUNK_S = 0.3
# id(job) -> (the fault it asks for, the job). The job is held so that its id cannot be reused
# by a later job while the mark stays (a RAISE mark is never removed): an unmarked request
# once inherited a finished one's mark that way and failed.
marked: dict[int, tuple[str, Any]] = {}
ran_out: list[bool] = []  # OOMFAIL raised once: later requests naming it are not marked


def mark(job: Any) -> str | None:
    entry = marked.get(id(job))
    return entry[0] if entry is not None and entry[1] is job else None


def faulty_submit(self: Any, job: Any) -> None:
    text = self.loaded.decode(job.prompt) if self.loaded is not None else ""
    for word in ("RAISE", "BATCHFAIL", "DEVICELOST", "OOMFAIL", "SLOWPREFILL"):
        if word in text and not (word == "OOMFAIL" and ran_out):
            marked[id(job)] = (word, job)
    real_submit(self, job)


def faulty_add(self: Any, token: int, logprobs: Any = None) -> bool:
    if len(self.generated) == 3 and mark(self.job) == "RAISE":
        raise RuntimeError("injected fault")
    return real_add(self, token, logprobs)


def faulty_step(self: Any) -> list[Any]:
    for seq in list(self._rows.values()):
        if len(self._rows) >= 3 and len(seq.generated) >= 3 and mark(seq.job) in ("BATCHFAIL", "DEVICELOST", "OOMFAIL"):
            # this step raises; after BATCHFAIL and OOMFAIL, fail_all makes a fresh generator
            self._gen.next = {"BATCHFAIL": _raise, "DEVICELOST": _lose_device, "OOMFAIL": _run_out}[
                marked.pop(id(seq.job))[0]]
    return real_step(self)


def slow_prefill_groups(self: Any) -> list[Any]:
    groups = self._groups
    if groups and groups[0].waiting and mark(groups[0].waiting[0].job) == "SLOWPREFILL" and not groups[0].is_prefilled:
        time.sleep(SLOW_CHUNK_S)
    return real_prefill_groups(self)


def slow_serial_chunk(self: Any, prompt: list[int]) -> bool:
    if self._seq is not None and mark(self._seq.job) == "SLOWPREFILL":
        time.sleep(SLOW_CHUNK_S)
    return bool(real_serial_chunk(self, prompt))


def _raise() -> Any:
    raise RuntimeError("injected batch fault")


def _run_out() -> Any:
    ran_out.append(True)
    raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")


def _lose_device() -> Any:
    raise RuntimeError("cudaLaunchKernelExC(&config, func, params) failed: an illegal memory access was encountered")


gateway.Gateway.submit = faulty_submit  # type: ignore[method-assign]
sequence.Sequence.add = faulty_add  # type: ignore[method-assign]
batch_lane.BatchLane.step = faulty_step  # type: ignore[method-assign]
batch_lane.BatchLane._prefill_groups = slow_prefill_groups  # type: ignore[method-assign]
serial_lane.SerialLane._prefill_chunk = slow_serial_chunk  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
