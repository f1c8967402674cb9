"""The engines that exist right now, one per model (the pool policy issue grows this)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mlxd.supervisor.engine import Engine, EngineOptions, EngineState


class Pool:
    """Creates an Engine per model on first use and stops them all at shutdown."""

    def __init__(self, runtime_dir: Path, options: EngineOptions | None = None) -> None:
        self._runtime_dir = runtime_dir
        self._options = options or EngineOptions()
        self._engines: dict[str, Engine] = {}

    def engine_for(self, model_id: str, model_dir: Path, max_context: int | None = None) -> Engine:
        """The Engine for a model, created (not started) if there is none yet."""
        engine = self._engines.get(model_id)
        if engine is None:
            engine = Engine(model_id, model_dir, self._runtime_dir, max_context, self._options)
            self._engines[model_id] = engine
        return engine

    def engines(self) -> list[Engine]:
        """Every engine the pool knows, in any state."""
        return list(self._engines.values())

    def loaded_ids(self) -> list[str]:
        """Models whose engine is starting or ready."""
        live = (EngineState.STARTING, EngineState.READY)
        return [e.model_id for e in self._engines.values() if e.state in live]

    async def stop_all(self) -> None:
        """Stop every engine (SIGTERM, then SIGKILL after the grace period), in parallel."""
        await asyncio.gather(*(e.stop() for e in self._engines.values()))
