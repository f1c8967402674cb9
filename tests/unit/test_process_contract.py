"""The supervisor and the engine read each other's lease lines and drain requests through the
same protocol Structs: what one side writes, the other decodes."""

from __future__ import annotations

import msgspec
import pytest

from mlxd.engine.http import app as engine_app
from mlxd.protocol.process import DrainRequest, LeaseLine, LeaseRequest
from mlxd.supervisor.engines import leases


def test_the_engines_lease_lines_read_as_held_in_the_supervisor() -> None:
    first = engine_app._ndjson(LeaseLine("held", "tok-1", "bench")).rstrip(b"\n")
    held = leases._held_line(first)
    assert held is not None and held.token == "tok-1"
    beat = leases._held_line(engine_app.HEARTBEAT.rstrip(b"\n"))
    assert beat is not None and beat.token is None
    assert engine_app.HEARTBEAT == b'{"status":"held"}\n'


@pytest.mark.parametrize("line", [b'{"status": "busy"}', b"not json", b"", b'{"token": "t"}', b"[1]"])
def test_anything_but_a_held_line_is_a_refusal(line: bytes) -> None:
    assert leases._held_line(line) is None


def test_the_supervisors_drain_and_lease_bodies_decode_in_the_engine() -> None:
    drain = msgspec.json.decode(msgspec.json.encode(DrainRequest(2.5, True)), type=DrainRequest)
    assert (drain.timeout_s, drain.resume) == (2.5, True)
    lease = msgspec.json.decode(msgspec.json.encode(LeaseRequest("job", 300.0)), type=LeaseRequest)
    assert (lease.holder, lease.wait_s) == ("job", 300.0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"timeout_s": 0}', type=DrainRequest)  # a drain must have a timeout
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"timeout": 1}', type=DrainRequest)  # a misspelt field is an error
