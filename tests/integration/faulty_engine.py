"""The real engine, except that generation raises after 3 tokens when the prompt contains RAISE.

Run as a script with MLXD_BLAS=off (the OpenBLAS re-exec would drop this patch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mlxd.engine import serial_lane
from mlxd.engine.__main__ import main

real_generate_step = serial_lane.generate_step
real_generate = serial_lane.SerialLane._generate


def faulty_generate_step(*args: Any, **kwargs: Any) -> Iterator[Any]:
    for n, step in enumerate(real_generate_step(*args, **kwargs)):
        if n == 3:
            raise RuntimeError("injected fault")
        yield step


def generate(self: Any, job: Any, *rest: Any) -> str:
    is_faulty = "RAISE" in self._loaded.decode(job.prompt)
    serial_lane.generate_step = faulty_generate_step if is_faulty else real_generate_step  # type: ignore[assignment]
    return real_generate(self, job, *rest)  # type: ignore[no-any-return]


serial_lane.SerialLane._generate = generate  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
