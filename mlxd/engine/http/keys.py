"""Typed aiohttp AppKeys for the engine app."""

from __future__ import annotations

from aiohttp import web

from mlxd.engine.gpu.gateway import Gateway
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.http.admission import Admission
from mlxd.engine.settings import EngineSettings

ADMISSION = web.AppKey("admission", Admission)
GATEWAY = web.AppKey("gateway", Gateway)
SETTINGS = web.AppKey("settings", EngineSettings)
STATS = web.AppKey("stats", Stats)
