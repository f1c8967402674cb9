"""What the supervisor knows of mlx-lm's quantization methods without importing mlx: kept equal
to mlx-lm's own (mlxd/protocol/jobs.py)."""

from __future__ import annotations

import msgspec
import pytest

from mlxd.protocol.jobs import AWQ_MODEL_TYPES, DWQ_LEARNING_RATE, QuantizeRequest


def test_the_awq_model_types_are_mlx_lms() -> None:
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS

    assert set(AWQ_MODEL_TYPES) == set(AWQ_MODEL_CONFIGS)


def test_the_dwq_learning_rate_default_is_mlx_lms() -> None:
    import inspect
    import re

    from mlx_lm.quant import dwq

    found = re.search(r'"--learning-rate",\s*type=float,\s*default=([0-9.e-]+)', inspect.getsource(dwq.main))
    assert found is not None and float(found.group(1)) == DWQ_LEARNING_RATE


@pytest.mark.parametrize(("body", "method"), [
    ({"model": "m"}, "convert"),
    ({"model": "m", "target_bpw": 4.5}, "dynamic"),
    ({"model": "m", "method": "awq"}, "awq"),
    ({"model": "m", "method": "dwq", "learning_rate": 1e-5}, "dwq"),
])
def test_a_request_resolves_to_its_method(body: dict[str, object], method: str) -> None:
    assert msgspec.convert(body, QuantizeRequest).how() == method


def test_an_unknown_method_is_refused_by_the_request_type() -> None:
    with pytest.raises(msgspec.ValidationError, match="method"):
        msgspec.convert({"model": "m", "method": "hqq"}, QuantizeRequest)


def test_the_quantizers_progress_bars_emit_the_jobs_progress() -> None:
    """mlx-lm's quantizers loop over `tqdm(...)` of their module: while progress_bars lasts,
    each item done is a progress event (tqdm.write still works); after it, the module's own."""
    import types

    from tqdm import tqdm

    from mlxd.lab.quantize import progress_bars
    from mlxd.protocol.jobs import Progress

    module = types.SimpleNamespace(tqdm=tqdm)
    events: list[Progress] = []
    seen = []
    with progress_bars(events.append, "quantizing", module):
        for block in module.tqdm(["a", "b", "c"], desc="Blocks"):
            seen.append((block, len(events)))  # its event comes once the loop's body is done
            module.tqdm.write(f"done {block}")
    assert seen == [("a", 0), ("b", 1), ("c", 2)]
    assert [(e.stage, e.step, e.total, e.message) for e in events] == [
        ("quantizing", 1, 3, "Blocks"), ("quantizing", 2, 3, "Blocks"), ("quantizing", 3, 3, "Blocks")]
    assert events[-1].eta_s == 0 and all(e.eta_s is not None and e.eta_s >= 0 for e in events)
    assert module.tqdm is tqdm
