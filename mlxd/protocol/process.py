"""Names in the supervisor-engine process contract that both sides must spell the same."""

from __future__ import annotations

# `python -m mlxd.engine --spare`: import everything, print SPARE_READY, then read the real
# command line (a JSON list) from stdin.
SPARE_FLAG = "--spare"
SPARE_READY = "spare engine: imports done"

# A request carrying a lease's id (supervisor) or token (engine) passes that lease.
LEASE_HEADER = "X-MLXD-Lease"
