"""The supervisor's TOML config: where it lives, how it is decoded, and what overrides it."""

from __future__ import annotations

import difflib
import logging
import os
import re
import stat
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from mlxd.paths import shell_quote
from mlxd.protocol.group import GroupSpec
from mlxd.protocol.process import DEFAULT_CHECKPOINT_TOKENS
from mlxd.protocol.sampling import Defaults
from mlxd.protocol.speculation import DEFAULT_NUM_DRAFT_TOKENS, parse_draft

log = logging.getLogger("mlxd.config")
MIB = 1024 * 1024
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Key = Annotated[str, msgspec.Meta(min_length=1)]
TTL = Annotated[int, msgspec.Meta(ge=-1)]  # seconds idle before unloading; 0: at once; -1: never
DEFAULT_GATHER_MS = 5.0
Priority = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]  # as the engine's `priority` field  # the engine's own --gather-ms default
# Sequences one engine decodes at once (--batch): a number, or "auto" (from memory and the model:
# protocol/sizing.py).
Batch = Annotated[int, msgspec.Meta(ge=1, le=256)] | Literal["auto"]
DEFAULT_BATCH: Literal["auto"] = "auto"


class ConfigError(Exception):
    """A config problem that stops startup; the message names the file, key and reason."""


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The `[server]` table."""

    host: Annotated[str, msgspec.Meta(min_length=1)] = "127.0.0.1"
    port: Port = 8800
    api_keys: list[Key] = msgspec.field(default_factory=list)
    admin_keys: list[Key] = msgspec.field(default_factory=list)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 32 * MIB
    insecure_no_auth: bool = False
    # Host/Origin checks (guard.py): names besides loopback and `host` that requests may use.
    allowed_hosts: list[Key] = msgspec.field(default_factory=list)
    allowed_origins: list[Key] = msgspec.field(default_factory=list)
    # Connection limits (connections.py).
    head_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    keepalive_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 75.0
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 2048
    max_connections_per_peer: Annotated[int, msgspec.Meta(ge=1)] = 1024
    # A request's default `priority` by the key it presents (lower runs sooner; a body's own wins):
    # a background agent's key can run behind a person's chat.
    key_priorities: dict[Key, Priority] = msgspec.field(default_factory=dict)
    # A queued stream gets an SSE comment this often until its first token.
    stream_keepalive_s: Annotated[float, msgspec.Meta(gt=0)] = 3.0
    # Images sent by http(s) URL are fetched by the supervisor (http/image_fetch.py): within this
    # time, up to this size, and never from loopback or private addresses unless allowed here.
    image_fetch_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    image_fetch_max_bytes: Annotated[int, msgspec.Meta(ge=1)] = 20 * MIB
    image_fetch_private: bool = False


# "none", "ngram", "self:N", or a draft model's name or directory (protocol/speculation.py).
Draft = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
NumDraft = Annotated[int, msgspec.Meta(ge=1, le=64)]


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One `[models.NAME]` table: an alias for a model dir."""

    path: Annotated[str, msgspec.Meta(min_length=1)]
    pin: bool = False
    max_context: Annotated[int, msgspec.Meta(ge=1)] | None = None
    idle_ttl_s: TTL | None = None  # None: [pool] idle_ttl_s
    batch: Batch | None = None  # None: [pool] batch
    adapter: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None  # requests' default adapters
    draft: Draft | None = None  # speculative decoding's drafts (None: [pool] draft)
    num_draft_tokens: NumDraft | None = None  # the most drafts a pass checks (None: [pool] num_draft_tokens)
    defaults: Defaults | None = None  # [models.NAME.defaults]: over [defaults], for this model
    resume: bool | None = None  # a reply cut by its engine's crash goes on on the next (None: [pool] resume)
    distributed: GroupSpec | None = None  # served by a group of engine processes (docs/distributed.md)

    def __post_init__(self) -> None:
        if self.draft is not None:
            parse_draft(self.draft)  # its ValueError is the key's error

    def resolved_path(self) -> Path:
        """`path` with `~` expanded."""
        return Path(self.path).expanduser()


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The `[pool]` table: how many engines live at once, and how requests wait for them."""

    max_loaded: Annotated[int, msgspec.Meta(ge=1)] | None = None  # None: as many as fit the budget
    memory_budget_gb: Annotated[float, msgspec.Meta(gt=0)] | None = None  # None: memory_fraction of the models' memory
    # of RAM (Metal, the CPU), or of the GPU's memory on CUDA. None: 0.75 of RAM; on CUDA all of
    # the smallest visible GPU's (nothing else lives there, and each engine keeps its own headroom)
    memory_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    idle_ttl_s: TTL = 1800
    max_queue: Annotated[int, msgspec.Meta(ge=1)] = 256
    queue_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    drain_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    batch: Batch = DEFAULT_BATCH  # continuous batching width of each engine ("auto"); per model: [models.NAME] batch
    warmup: Literal["auto", "on", "off"] = "auto"  # engines' --warmup (auto: on CUDA only)
    adapter_merge: Literal["auto", "on", "off"] = "auto"  # engines' --adapter-merge (auto: on a GPU)
    gather_ms: Annotated[float, msgspec.Meta(ge=0, le=1000)] = DEFAULT_GATHER_MS  # engines' --gather-ms (0: never)
    draft: Draft = "none"  # engines' --draft: "ngram" drafts from the request's context; per model: [models.NAME] draft
    num_draft_tokens: NumDraft = DEFAULT_NUM_DRAFT_TOKENS  # engines' --num-draft-tokens
    # CUDA graphs for every engine (MLX_USE_CUDA_GRAPHS=1): a lone stream decodes faster, batches
    # run slower (docs/engine.md, "MLX settings"); only MLX's CUDA backend reads it.
    cuda_graphs: bool = False
    # A reply whose engine dies mid-answer goes on on the restarted engine (docs/resume.md), up
    # to `resume_attempts` times a request; per model: [models.NAME] resume.
    resume: bool = True
    resume_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    # Engines' --generation-checkpoint: a running reply's KV to the SSD tier every this many
    # tokens, so a reply gone on after a crash prefills fewer (0: never; docs/resume.md).
    generation_checkpoint: Annotated[int, msgspec.Meta(ge=0)] = DEFAULT_CHECKPOINT_TOKENS
    spare_engine: bool = True  # keep one engine process with its imports done ($MLXD_SPARE_ENGINE=0: off)
    # The prompt cache (engines' --prompt-cache-bytes / --ssd-cache-bytes; None: their defaults,
    # 10% of memory and a quarter of the free disk, capped at 32 GiB each; 0: off).
    prompt_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    ssd_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    kv_bits: Literal[2, 3, 4, 5, 6, 8] | None = None  # engines' --kv-bits: quantized KV, one sequence at a time
    kv_group_size: Literal[32, 64, 128] = 64
    ssd_write_behind: bool = True  # engines' --ssd-write-behind: write new entries while idle
    # Crash loops: `crash_limit` exits within `crash_window_s` mark a model failed; it is tried
    # again after a cool-down that starts at `cooldown_s`, doubles on each new failure up to
    # `cooldown_max_s`, and resets after `healthy_reset_s` of serving without a crash.
    crash_limit: Annotated[int, msgspec.Meta(ge=1)] = 5
    crash_window_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    cooldown_s: Annotated[float, msgspec.Meta(gt=0)] = 15.0
    cooldown_max_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    healthy_reset_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0

    def __post_init__(self) -> None:
        parse_draft(self.draft)  # its ValueError is the key's error


class ResponsesConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The `[responses]` table: the Responses API's store (responses.sqlite3 in the data dir)."""

    ttl_s: Annotated[float, msgspec.Meta(gt=0)] = 30 * 24 * 3600.0  # a stored response lives this long
    max_bytes: Annotated[int, msgspec.Meta(ge=1)] = 1024 * MIB  # then the least recently used go


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole config file."""

    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    responses: ResponsesConfig = msgspec.field(default_factory=ResponsesConfig)
    # What requests that set none get, for every model (over each model's generation_config.json)
    defaults: Defaults = msgspec.field(default_factory=Defaults)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)


def default_config_dir() -> Path:
    """The platform's per-user config dir for mlxd."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlxd"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "mlxd"


def config_path(cli_value: str | None, env: Mapping[str, str] = os.environ) -> Path:
    """`--config`, else `$MLXD_CONFIG`, else `<platform config dir>/config.toml`."""
    if cli_value:
        return Path(cli_value).expanduser()
    if value := env.get("MLXD_CONFIG"):
        return Path(value).expanduser()
    return default_config_dir() / "config.toml"


def is_explicit_config(cli_value: str | None, env: Mapping[str, str] = os.environ) -> bool:
    """Whether the config file was named by `--config` or `$MLXD_CONFIG` (so it must exist)."""
    return bool(cli_value or env.get("MLXD_CONFIG"))


def load_config(path: Path, *, explicit: bool) -> Config:
    """Read and decode `path`; a missing file means defaults unless it was named explicitly."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{path}: config file not found") from None
        return Config()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    cfg = resolve_model_paths(decode_config(raw, path), path.absolute().parent)
    if warning := exposed_keys_warning(path, cfg):
        # The one place it is said: `mlxd serve` logs it (so a daemon's log has it) and other
        # commands that read the config print it, as ssh does for a private key others can read.
        log.warning("%s", warning)
    return cfg


def exposed_keys_warning(path: Path, cfg: Config) -> str | None:
    """What to say when `path` holds keys and group or others can read it; None when it is fine."""
    if not (cfg.server.api_keys or cfg.server.admin_keys):
        return None
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    if not mode & 0o044:
        return None
    return (
        f"{path} holds API keys and is readable by others (mode {mode:o}); "
        f"run chmod 600 {shell_quote(path)}"
    )


def decode_config(raw: bytes, path: Path) -> Config:
    """Parse TOML bytes into a Config; errors name `path`, the key and the reason."""
    data = _parse_toml(raw, path)
    models = data.get("models")
    if isinstance(models, dict):
        # Decoded one by one first: msgspec hides dict keys in its error paths (`$.models[...]`).
        for name, entry in models.items():
            _convert(entry, ModelConfig, path, f"models.{_toml_key(name)}")
    return _convert(data, Config, path, "")


def resolve_model_paths(cfg: Config, base: Path) -> Config:
    """Expand `~` in model paths and make relative ones relative to the config file's dir."""
    models = {
        name: msgspec.structs.replace(model, path=str(base / model.resolved_path()))
        for name, model in cfg.models.items()
    }
    return msgspec.structs.replace(cfg, models=models)


def apply_overrides(
    cfg: Config,
    *,
    host: str | None = None,
    port: int | None = None,
    insecure_no_auth: bool = False,
    env: Mapping[str, str] = os.environ,
) -> Config:
    """Layer env vars over the file and CLI flags over both: CLI > env > file > defaults."""
    server = cfg.server
    env_host, env_port = env.get("MLXD_HOST"), env.get("MLXD_PORT")
    new_host = host or env_host or server.host
    new_port = server.port
    if env_port:
        new_port = _parse_port(env_port, "MLXD_PORT")
    if port is not None:
        new_port = _check_port(port, "--port")
    api_keys = list(server.api_keys)
    if (env_key := env.get("MLXD_API_KEY")) and env_key not in api_keys:
        api_keys.append(env_key)
    server = msgspec.structs.replace(
        server,
        host=new_host,
        port=new_port,
        api_keys=api_keys,
        insecure_no_auth=server.insecure_no_auth or insecure_no_auth,
    )
    return msgspec.structs.replace(cfg, server=server)


def _parse_toml(raw: bytes, path: Path) -> dict[str, Any]:
    """tomllib with errors as ConfigError naming the file and line."""
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        text = str(exc)
        if match := re.search(r" \(at line (\d+), column (\d+)\)$", text):
            where = f"line {match.group(1)}, column {match.group(2)}"
            raise ConfigError(f"{path}: {where}: {text[: match.start()]}") from None
        raise ConfigError(f"{path}: invalid TOML: {text}") from None


def _convert(data: Any, kind: Any, path: Path, prefix: str) -> Any:
    """msgspec.convert with a ValidationError turned into a ConfigError."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {_describe(str(exc), kind, prefix)}") from None


def _describe(text: str, kind: Any, prefix: str) -> str:
    """msgspec's `Expected ... - at `$.a.b`` as `a.b: expected ...`, or `unknown key 'a.b'`."""
    reason, _, at = text.partition(" - at `$")
    key = _join(prefix, at.rstrip("`").lstrip("."))
    if match := re.fullmatch(r"Object contains unknown field `(.*)`", reason):
        return _unknown_key(_join(key, match.group(1)), kind, prefix)
    reason = reason[:1].lower() + reason[1:]
    if key.endswith(".batch") and not reason.startswith("expected `int` "):  # not a range error
        reason = 'expected a width from 1 to 256, or "auto"' + (f", got {reason.rpartition(', got ')[2]}"
                                                               if ", got " in reason else f" ({reason})")
    return f"{key}: {reason}" if key else reason


def _unknown_key(key: str, kind: Any, prefix: str) -> str:
    """`unknown key 'server.prot' (did you mean 'server.port'?)`."""
    message = f"unknown key '{key}'"
    parent, _, leaf = key.rpartition(".")
    owner = _struct_at(kind, parent[len(prefix) :].lstrip(".") if prefix else parent)
    fields = owner.__struct_fields__ if owner is not None else ()
    if close := difflib.get_close_matches(leaf, fields, n=1):
        message += f" (did you mean '{_join(parent, close[0])}'?)"
    return message


def _struct_at(kind: Any, key: str) -> Any:
    """The Struct type that holds the fields at dotted `key` inside `kind`, if any."""
    if kind is Config and key.startswith("models."):
        return ModelConfig
    if kind is Config and key == "server":
        return ServerConfig
    return kind if key == "" else None


def _join(prefix: str, key: str) -> str:
    """Dotted key paths: `_join('server', 'port') == 'server.port'`."""
    return f"{prefix}.{key}" if prefix and key else prefix or key


def _toml_key(name: str) -> str:
    """A model name as TOML would write it: bare if it can be, else quoted."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f'"{name}"'


def _parse_port(value: str, source: str) -> int:
    """A port number from an env var, or a ConfigError naming it."""
    try:
        return _check_port(int(value), source)
    except ValueError:
        raise ConfigError(f"{source}: not a port number: {value!r}") from None


def _check_port(port: int, source: str) -> int:
    """`port` if it is in 1..65535, else a ConfigError naming `source`."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"{source}: port {port} is out of range 1..65535")
    return port
