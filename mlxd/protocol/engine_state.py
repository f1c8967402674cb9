"""An engine's lifecycle as the supervisor tracks it: one enum, and the sets its readers ask about.

Only the engine's owning task (supervisor/engines/engine.py) changes the state; the pool, the
policy, the admin routes and metrics read it through these names. It is a StrEnum, so the
policy's snapshots and the JSON answers (`"state": "ready"`) carry the same values.
"""

from __future__ import annotations

import enum


class EngineState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


# A process exists (its memory counts against the budget)
LIVE = frozenset({EngineState.STARTING, EngineState.READY, EngineState.DRAINING, EngineState.STOPPING})
# Up or coming up, and taking requests: a model "loaded" for routing a request without `model`
ACCEPTING = frozenset({EngineState.STARTING, EngineState.READY})
# Loaded, as an admin unload reports it (`was_loaded`)
LOADED = frozenset({EngineState.STARTING, EngineState.READY, EngineState.DRAINING})
# Answering: an engine whose stats, prompt cache and lease can be asked for
SERVING = frozenset({EngineState.READY, EngineState.DRAINING})
# On its way out: its memory is being given back
LEAVING = frozenset({EngineState.DRAINING, EngineState.STOPPING})
