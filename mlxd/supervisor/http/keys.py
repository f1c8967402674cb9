"""Typed aiohttp AppKeys for the supervisor app."""

from __future__ import annotations

from aiohttp import web

from mlxd.hub.removal import OwnedModels
from mlxd.supervisor.adapters import AdapterCatalog
from mlxd.supervisor.config import Config
from mlxd.supervisor.engines.leases import Leases
from mlxd.supervisor.engines.pool import Pool
from mlxd.supervisor.http.auth import Auth
from mlxd.supervisor.http.image_fetch import ImageFetcher
from mlxd.supervisor.http.metrics import LazyMetrics
from mlxd.supervisor.http.timeline import Timeline
from mlxd.supervisor.jobs.runner import JobRunner
from mlxd.supervisor.lab_files import LabFiles
from mlxd.supervisor.library import Bandwidth
from mlxd.supervisor.registry import Registry

ADAPTERS = web.AppKey("adapters", AdapterCatalog)
AUTH = web.AppKey("auth", Auth)
CONFIG = web.AppKey("config", Config)
IMAGES = web.AppKey("images", ImageFetcher)
JOBS = web.AppKey("jobs", JobRunner)
LAB_FILES = web.AppKey("lab_files", LabFiles)
LEASES = web.AppKey("leases", Leases)
LIBRARY = web.AppKey("library", Bandwidth)  # the machine's measured bandwidth, for GET /library
METRICS = web.AppKey("metrics", LazyMetrics)
OWNED: web.AppKey[OwnedModels | None] = web.AppKey("owned")  # None: no data dir (pulls and deletes refused)
POOL = web.AppKey("pool", Pool)
REGISTRY = web.AppKey("registry", Registry)
TIMELINE = web.AppKey("timeline", Timeline)
