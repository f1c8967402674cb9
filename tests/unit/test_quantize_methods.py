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
