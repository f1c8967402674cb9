"""Typed aiohttp AppKeys for the engine app."""

from __future__ import annotations

from aiohttp import web

from mlxd.engine.admission import Admission
from mlxd.engine.gateway import Gateway
from mlxd.engine.settings import EngineSettings
from mlxd.engine.stats import Stats

ADMISSION = web.AppKey("admission", Admission)
GATEWAY = web.AppKey("gateway", Gateway)
SETTINGS = web.AppKey("settings", EngineSettings)
STATS = web.AppKey("stats", Stats)
