"""A lane's step that raised (mlxd/engine/gpu/step_failure.py): in one engine its requests fail and
the engine serves on; in an engine group it is raised on, so the engine ends and its replies go on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mlxd.engine.gpu.step_failure import failed_step
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
