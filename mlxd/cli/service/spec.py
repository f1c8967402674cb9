"""Pure pieces of `mlxd start|stop|status|service`: serve options, templates, pid files.

No processes, sockets or service managers here: `mlxd.cli.service.cmds` does the I/O.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from string import Template

from mlxd.paths import make_private_dirs, shell_quote

LABEL = "dev.mlxd"
UNIT_NAME = "mlxd.service"
# Longer than the supervisor's graceful shutdown: 10 s for in-flight requests + 5 s for engines.
STOP_TIMEOUT_S = 30
START_TIMEOUT_S = 30.0
PID_FILE_NAME = "mlxd.pid"
LOG_FILE_NAME = "mlxd.log"
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600  # logs and pid file: readable by their owner only

# The service templates ship as package data (mlxd/deploy/*.in): one copy, read the same way
# from a checkout and from an installed wheel (tests/integration/test_install_tool.py).
DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"


@dataclass(frozen=True)
class ServeOptions:
    """What `mlxd serve` is told: flags for the address, env vars for the files."""

    host: str | None = None
    port: int | None = None
    config: Path | None = None
    data_dir: Path | None = None
    log_format: str | None = None  # travels as $MLXD_LOG_FORMAT, like the files

    def address_args(self) -> list[str]:
        """`--host`/`--port` for `mlxd serve`, only those given."""
        args = ["--host", self.host] if self.host else []
        return args + (["--port", str(self.port)] if self.port is not None else [])

    def serve_argv(self, python: str) -> list[str]:
        """A detached `mlxd serve` with every option as a flag."""
        argv = [python, "-m", "mlxd", "serve", *self.address_args()]
        if self.config is not None:
            argv += ["--config", str(self.config)]
        if self.data_dir is not None:
            argv += ["--data-dir", str(self.data_dir)]
        return argv

    def service_argv(self, python: str) -> list[str]:
        """The service's `mlxd serve`: the files travel in `service_env()` instead."""
        return [python, "-m", "mlxd", "serve", *self.address_args()]

    def service_env(self) -> dict[str, str]:
        """MLXD_DATA_DIR / MLXD_CONFIG / MLXD_LOG_FORMAT for the service, only those given."""
        env = {"MLXD_DATA_DIR": self.data_dir, "MLXD_CONFIG": self.config, "MLXD_LOG_FORMAT": self.log_format}
        return {key: str(value) for key, value in env.items() if value is not None}


def absolute(path: Path | str | None) -> Path | None:
    """`path` with `~` expanded, made absolute (a service has another working dir)."""
    return None if path is None else Path(path).expanduser().absolute()


def from_env(opts: ServeOptions, env: Mapping[str, str]) -> ServeOptions:
    """Fill the files and log format from $MLXD_DATA_DIR / $MLXD_CONFIG / $MLXD_LOG_FORMAT: a service
    does not see the shell's env (`--log-format` is put there by its option)."""
    return ServeOptions(
        host=opts.host,
        port=opts.port,
        config=absolute(opts.config or env.get("MLXD_CONFIG") or None),
        data_dir=absolute(opts.data_dir or env.get("MLXD_DATA_DIR") or None),
        log_format=opts.log_format or env.get("MLXD_LOG_FORMAT") or None,
    )


def options_from_argv(argv: list[str], env: Mapping[str, str]) -> ServeOptions:
    """Read back the options of an installed service's `mlxd serve` argv and env."""
    flags = dict(zip(argv[4::2], argv[5::2], strict=False))
    port = flags.get("--port")
    return ServeOptions(
        host=flags.get("--host"),
        port=int(port) if port else None,
        config=absolute(env.get("MLXD_CONFIG")),
        data_dir=absolute(env.get("MLXD_DATA_DIR")),
        log_format=env.get("MLXD_LOG_FORMAT") or None,
    )


# --- paths -------------------------------------------------------------------


def plist_path(home: Path) -> Path:
    """Where the launchd agent lives."""
    return home / "Library" / "LaunchAgents" / f"{LABEL}.plist"


def unit_path(home: Path, env: Mapping[str, str]) -> Path:
    """Where the systemd user unit lives ($XDG_CONFIG_HOME honoured)."""
    base = env.get("XDG_CONFIG_HOME") or str(home / ".config")
    return Path(base) / "systemd" / "user" / UNIT_NAME


def log_file(data_dir: Path) -> Path:
    """The daemon's log, appended to by every mode."""
    return data_dir / "logs" / LOG_FILE_NAME


def pid_file(data_dir: Path) -> Path:
    """The pid file of a daemon run by `mlxd start` without a service."""
    return data_dir / PID_FILE_NAME


def probe_host(host: str) -> str:
    """The address to reach a server bound to `host` (a wildcard bind answers on loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def base_url(host: str, port: int) -> str:
    """http://host:port, with IPv6 literals bracketed."""
    host = probe_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# --- templates ---------------------------------------------------------------


def load_template(name: str, deploy_dir: Path = DEPLOY_DIR) -> Template:
    """mlxd/deploy/<name>, the template shipped in the package."""
    return Template((deploy_dir / name).read_text())


def render_plist(argv: list[str], env: Mapping[str, str], log: Path, deploy_dir: Path = DEPLOY_DIR) -> str:
    """The launchd agent's plist."""
    from xml.sax.saxutils import escape  # here, not at import: `mlxd serve` starts faster (~50 ms)

    args = "\n".join(f"    <string>{escape(arg)}</string>" for arg in argv)
    envs = "\n".join(
        f"    <key>{escape(key)}</key>\n    <string>{escape(value)}</string>" for key, value in env.items()
    )
    return load_template("mlxd.plist.in", deploy_dir).substitute(
        label=LABEL, program_arguments=args, environment=envs,
        stop_timeout=STOP_TIMEOUT_S, log_file=escape(str(log)),
    )


def render_unit(argv: list[str], env: Mapping[str, str], log: Path, deploy_dir: Path = DEPLOY_DIR) -> str:
    """The systemd user unit."""
    envs = "\n".join(f"Environment={systemd_quote(f'{k}={v}', dollar=False)}" for k, v in env.items())
    return load_template("mlxd.service.in", deploy_dir).substitute(
        exec_start=" ".join(systemd_quote(arg) for arg in argv), environment=envs,
        stop_timeout=STOP_TIMEOUT_S, log_file=str(log).replace("%", "%%"),
    )


_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_WORD = re.compile(r'"((?:[^"\\]|\\.)*)"|(\S+)')


def systemd_quote(arg: str, *, dollar: bool = True) -> str:
    """One ExecStart=/Environment= word: `%` specifiers and (in ExecStart) `$` escaped."""
    arg = arg.replace("%", "%%")
    if dollar:
        arg = arg.replace("$", "$$")
    if _PLAIN.fullmatch(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_split(line: str, *, dollar: bool = True) -> list[str]:
    """The inverse of `systemd_quote` over a line of words."""
    words = []
    for match in _WORD.finditer(line):
        quoted, bare = match.groups()
        word = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare
        if dollar:
            word = word.replace("$$", "$")
        words.append(word.replace("%%", "%"))
    return words


def parse_unit(text: str) -> tuple[list[str], dict[str, str]]:
    """The ExecStart argv and Environment of a unit written by `render_unit`."""
    argv: list[str] = []
    env: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "ExecStart":
            argv = systemd_split(value)
        elif key == "Environment":
            for word in systemd_split(value, dollar=False):
                name, _, val = word.partition("=")
                env[name] = val
    return argv, env


def unit_log_file(text: str) -> Path | None:
    """The file a unit's StandardOutput= appends or writes to; None when it logs to the journal."""
    for line in text.splitlines():
        key, _, value = line.strip().partition("=")
        kind, _, path = value.partition(":")
        if key == "StandardOutput" and kind in ("append", "file", "truncate") and path:
            return Path(path.replace("%%", "%"))
    return None


# --- pid file ----------------------------------------------------------------


@dataclass(frozen=True)
class PidRecord:
    """What `mlxd start` writes about the daemon it spawned."""

    pid: int
    host: str
    port: int
    started_at: float

    @property
    def url(self) -> str:
        """Where the daemon answers."""
        return base_url(self.host, self.port)


def write_pid_file(path: Path, record: PidRecord) -> None:
    """Write `record` atomically (a reader never sees half a file), mode 0600."""
    make_private_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE), "w") as f:
        os.fchmod(f.fileno(), PRIVATE_FILE)  # a leftover temp file keeps its old mode otherwise
        f.write(json.dumps(asdict(record)) + "\n")
    tmp.replace(path)


def read_pid_file(path: Path) -> PidRecord | None:
    """The record in `path`, or None when it is missing or unreadable (a stale leftover)."""
    try:
        data = json.loads(path.read_text())
        return PidRecord(int(data["pid"]), str(data["host"]), int(data["port"]), float(data["started_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def new_record(pid: int, host: str, port: int) -> PidRecord:
    """A record for a daemon spawned now."""
    return PidRecord(pid=pid, host=host, port=port, started_at=time.time())


def remove_pid_file(path: Path) -> None:
    """Remove `path` if it is there."""
    path.unlink(missing_ok=True)


# --- file modes --------------------------------------------------------------


def open_log(path: Path) -> int:
    """An fd appending to the log, which is created mode 0600 when missing."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)


def secure_files(data_dir: Path) -> list[str]:
    """Make the log and pid file private before anything writes them; a line for each change or risk.

    Dirs mlxd makes are 0700, its files 0600. A service manager (systemd's append:, launchd's
    StandardOutPath) would create a missing log 0644, so the log is created here first. A looser
    logs dir, log or pid file (an older mlxd made them 0755/0644) is tightened and said so, once:
    the next start finds them private. The data dir may be the user's own: only warned about.
    """
    log = log_file(data_dir)
    make_private_dirs(log.parent)
    os.close(open_log(log))
    modes = {log.parent: PRIVATE_DIR, log: PRIVATE_FILE, pid_file(data_dir): PRIVATE_FILE}
    lines = [line for path, mode in modes.items() if (line := tighten(path, mode))]
    if (mode := stat.S_IMODE(data_dir.stat().st_mode)) & 0o022:
        lines.append(
            f"warning: data dir {data_dir} is writable by others (mode {mode:o}): they could replace "
            f"mlxd's log and pid file; run chmod go-w {shell_quote(data_dir)}"
        )
    return lines


def tighten(path: Path, mode: int) -> str | None:
    """chmod `path` to `mode` if group or others have more; what was done, or None."""
    try:
        old = stat.S_IMODE(path.stat().st_mode)
    except OSError:  # not there (no pid file yet): nothing to tighten
        return None
    if not old & 0o077:
        return None
    try:
        path.chmod(mode)
    except OSError as exc:
        return f"warning: {path} is mode {old:o} and cannot be made private: {exc.strerror or exc}"
    return f"note: {path} was open to others (mode {old:o}); made it {mode:o}"


def log_tail(path: Path, num_lines: int = 20) -> str:
    """The last lines of a log file, or a note that there is none."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-num_lines:]) or f"({path} is empty)"
