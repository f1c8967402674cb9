"""The OS side of `mlxd start|stop|status|service`: launchd, systemd, processes, health probes.

Everything that touches the OS goes through `System`, so unit tests swap in fakes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from mlxd.cli.service import spec as svc
from mlxd.cli.service.spec import ServeOptions

EXIT_DOWN = 3  # `mlxd status` when nothing answers, like `systemctl status`

Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]
Health = dict[str, Any]


def run_command(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a service-manager command, capturing its output."""
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)


def run_on_terminal(argv: list[str]) -> int:
    """Run a command on this terminal (`journalctl -f`): its output is the user's; its exit code."""
    try:
        return subprocess.run(argv, check=False).returncode
    except FileNotFoundError:
        return 127


def fetch_health(url: str, timeout: float = 2.0) -> Health | None:
    """`GET url/health` as JSON when an mlxd answers there, else None."""
    import urllib.request  # here, not at import: `mlxd serve` starts faster (~45 ms)

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with opener.open(f"{url}/health", timeout=timeout) as resp:
            data = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("status") == "ok" else None


@dataclass
class System:
    """The OS as these commands see it: platform, env, home, and the verbs that act on it."""

    platform: str = sys.platform
    env: Mapping[str, str] = field(default_factory=lambda: os.environ)
    home: Path = field(default_factory=Path.home)
    uid: int = field(default_factory=os.getuid)
    python: str = sys.executable
    run: Runner = run_command
    run_attached: Callable[[list[str]], int] = run_on_terminal
    which: Callable[[str], str | None] = shutil.which
    probe: Callable[[str], Health | None] = fetch_health
    sleep: Callable[[float], None] = time.sleep
    monotonic: Callable[[], float] = time.monotonic

    def wait_for(self, check: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
        """Poll `check` until it holds or `timeout` passes."""
        deadline = self.monotonic() + timeout
        while not check():
            if self.monotonic() >= deadline:
                return False
            self.sleep(step)
        return True


def current_system() -> System:
    """The `System` for a command: a test's fake from the click context, else the real one."""
    obj = click.get_current_context().obj
    return obj if isinstance(obj, System) else System()


# --- service backends ----------------------------------------------------------


def check_result(result: subprocess.CompletedProcess[str]) -> None:
    """Raise a ClickException naming a service-manager command that failed."""
    if result.returncode != 0:
        cmd = " ".join(result.args) if isinstance(result.args, list) else str(result.args)
        raise click.ClickException(f"`{cmd}` failed ({result.returncode}): {(result.stderr or '').strip()}")


class Launchd:
    """The launchd agent `dev.mlxd` in the user's GUI domain."""

    kind = "launchd agent"

    def __init__(self, system: System) -> None:
        self.system = system
        self.path = svc.plist_path(system.home)
        self.target = f"gui/{system.uid}/{svc.LABEL}"

    def is_installed(self) -> bool:
        return self.path.is_file()

    def options(self) -> ServeOptions:
        """The installed agent's serve options."""
        import plistlib

        data = plistlib.loads(self.path.read_bytes())
        return svc.options_from_argv(data.get("ProgramArguments", []), data.get("EnvironmentVariables", {}))

    def render(self, opts: ServeOptions, log: Path) -> str:
        return svc.render_plist(opts.service_argv(self.system.python), opts.service_env(), log)

    def is_loaded(self) -> bool:
        return self._launchctl("print", self.target).returncode == 0

    def activate(self) -> list[str]:
        """Load the freshly written plist (unloading an older one first)."""
        if self.is_loaded():
            self._launchctl("bootout", self.target)
        check_result(self._launchctl("bootstrap", f"gui/{self.system.uid}", str(self.path)))
        return []

    def start(self) -> None:
        if self.is_loaded():
            check_result(self._launchctl("kickstart", self.target))
        else:
            check_result(self._launchctl("bootstrap", f"gui/{self.system.uid}", str(self.path)))

    def stop(self) -> bool:
        """Unload the agent (KeepAlive would restart a killed one); False if it was not loaded."""
        if not self.is_loaded():
            return False
        check_result(self._launchctl("bootout", self.target))
        return True

    def deactivate(self) -> list[str]:
        self.stop()
        return []

    def log_path(self) -> Path | None:
        """The file the agent's stdout goes to (the plist's StandardOutPath)."""
        import plistlib

        path = plistlib.loads(self.path.read_bytes()).get("StandardOutPath")
        return Path(path) if isinstance(path, str) and path else None

    def pid(self) -> int | None:
        out = self._launchctl("print", self.target)
        for line in out.stdout.splitlines() if out.returncode == 0 else []:
            key, _, value = line.strip().partition(" = ")
            if key == "pid" and value.isdigit():
                return int(value)
        return None

    def _launchctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.system.run(["launchctl", *args])



class Systemd:
    """The systemd user unit `mlxd.service`."""

    kind = "systemd user unit"

    def __init__(self, system: System) -> None:
        self.system = system
        self.path = svc.unit_path(system.home, system.env)

    def is_installed(self) -> bool:
        return self.path.is_file()

    def options(self) -> ServeOptions:
        """The installed unit's serve options."""
        argv, env = svc.parse_unit(self.path.read_text())
        return svc.options_from_argv(argv, env)

    def render(self, opts: ServeOptions, log: Path) -> str:
        return svc.render_unit(opts.service_argv(self.system.python), opts.service_env(), log)

    def has_user_bus(self) -> bool:
        """Whether `systemctl --user` can reach a user manager (not in a bare container or ssh)."""
        if self.system.which("systemctl") is None:
            return False
        return self._systemctl("show-environment").returncode == 0

    def activate(self) -> list[str]:
        """daemon-reload and enable --now; the commands to run by hand when there is no user bus."""
        if not self.has_user_bus():
            return ["systemctl --user daemon-reload", "systemctl --user enable --now mlxd"]
        was_active = self.is_active()
        check_result(self._systemctl("daemon-reload"))
        check_result(self._systemctl("enable", "--now", "mlxd"))
        if was_active:  # enable --now leaves an old instance running
            check_result(self._systemctl("restart", "mlxd"))
        return []

    def start(self) -> None:
        if not self.has_user_bus():
            raise click.ClickException(
                f"mlxd is installed as a systemd user unit ({self.path}) but `systemctl --user` "
                "cannot reach a user manager; start it from a login session, or run "
                "`mlxd service uninstall` to run mlxd without a service"
            )
        check_result(self._systemctl("start", "mlxd"))

    def is_active(self) -> bool:
        return self._systemctl("is-active", "--quiet", "mlxd").returncode == 0

    def stop(self) -> bool:
        """Stop the unit; False if it was not running (or unreachable)."""
        if not self.has_user_bus() or not self.is_active():
            return False
        check_result(self._systemctl("stop", "mlxd"))
        return True

    def deactivate(self) -> list[str]:
        if not self.has_user_bus():
            return ["systemctl --user disable --now mlxd", "systemctl --user daemon-reload"]
        self._systemctl("disable", "--now", "mlxd")
        return []

    def after_remove(self) -> None:
        if self.has_user_bus():
            self._systemctl("daemon-reload")

    def log_path(self) -> Path | None:
        """The file the unit's stdout goes to; None when it goes to the journal."""
        return svc.unit_log_file(self.path.read_text())

    def journal_argv(self, num_lines: int, follow: bool) -> list[str]:
        """`journalctl` showing the unit's lines as logged (no journal prefix)."""
        return ["journalctl", "--user", "-u", svc.UNIT_NAME, "-o", "cat", "-n", str(num_lines), *(["-f"] if follow else [])]

    def pid(self) -> int | None:
        out = self._systemctl("show", "--property=MainPID", "--value", "mlxd")
        value = out.stdout.strip()
        return int(value) if out.returncode == 0 and value.isdigit() and value != "0" else None

    def _systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.system.run(["systemctl", "--user", *args])



Backend = Launchd | Systemd


def backend_for(system: System) -> Backend | None:
    """The platform's service manager, or None where mlxd has no service support."""
    if system.platform == "darwin":
        return Launchd(system)
    if system.platform.startswith("linux"):
        return Systemd(system)
    return None


def installed_backend(system: System) -> Backend | None:
    """The backend when an mlxd service is installed."""
    backend = backend_for(system)
    return backend if backend is not None and backend.is_installed() else None


# --- shared pieces ---------------------------------------------------------------
