"""The real engine, with faults on cue, chosen by words in the prompt:

- RAISE: that request's own token handling raises after 3 tokens (in either lane): only it fails.
- BATCHFAIL: the batched step raises once, when the row holding it has 3 tokens and the batch
  lane holds 3 rows: every row in the batch lane fails, and the engine goes on serving.

Run as a script with MLXD_BLAS=off (the OpenBLAS re-exec would drop these patches).
"""

from __future__ import annotations

from typing import Any

from mlxd.engine.__main__ import main
from mlxd.engine.gpu import batch_lane, gateway, sequence

real_submit = gateway.Gateway.submit
real_add = sequence.Sequence.add
real_step = batch_lane.BatchLane.step
# id(job) -> (the fault it asks for, the job). The job is held so that its id cannot be reused
# by a later job while the mark stays (a RAISE mark is never removed): an unmarked request
# once inherited a finished one's mark that way and failed.
marked: dict[int, tuple[str, Any]] = {}


def mark(job: Any) -> str | None:
    entry = marked.get(id(job))
    return entry[0] if entry is not None and entry[1] is job else None


def faulty_submit(self: Any, job: Any) -> None:
    text = self.loaded.decode(job.prompt) if self.loaded is not None else ""
    for word in ("RAISE", "BATCHFAIL"):
        if word in text:
            marked[id(job)] = (word, job)
    real_submit(self, job)


def faulty_add(self: Any, token: int, logprobs: Any = None) -> bool:
    if len(self.generated) == 3 and mark(self.job) == "RAISE":
        raise RuntimeError("injected fault")
    return real_add(self, token, logprobs)


def faulty_step(self: Any) -> list[Any]:
    for seq in list(self._rows.values()):
        if len(self._rows) >= 3 and len(seq.generated) >= 3 and mark(seq.job) == "BATCHFAIL":
            del marked[id(seq.job)]
            self._gen.next = _raise  # this step raises; fail_all then makes a fresh generator
    return real_step(self)


def _raise() -> Any:
    raise RuntimeError("injected batch fault")


gateway.Gateway.submit = faulty_submit  # type: ignore[method-assign]
sequence.Sequence.add = faulty_add  # type: ignore[method-assign]
batch_lane.BatchLane.step = faulty_step  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
