"""`mlxd start|stop|status|service` without processes: templates, pid files, fake launchctl/systemctl."""

from __future__ import annotations

import configparser
import json
import os
import plistlib
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mlxd.cli.service import cmds
from mlxd.cli.service import spec as svc
from mlxd.cli.service.cmds import System
from mlxd.cli.service.spec import ServeOptions

PY = "/opt/py env/bin/python3"
HEALTH = {"status": "ok", "version": "0.1.0", "engines": {"tiny": "ready"}}


def parse_unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser


class FakeOS:
    """Records launchctl/systemctl calls; answers from `replies` keyed by the argv's joined prefix."""

    def __init__(self, replies: dict[str, tuple[int, str]] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.replies = replies or {}

    def __call__(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        joined = " ".join(argv)
        rc, out = next((v for k, v in self.replies.items() if joined.startswith(k)), (0, ""))
        return subprocess.CompletedProcess(argv, rc, out, "boom" if rc else "")

    def ran(self) -> list[str]:
        return [" ".join(c) for c in self.calls]


def fake_system(tmp_path: Path, platform: str, run: FakeOS, probe: Callable[[str], Any] = lambda url: HEALTH,
                which: Callable[[str], str | None] = lambda name: f"/usr/bin/{name}") -> System:
    clock = iter(range(10**6))
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "MLXD_DATA_DIR": str(tmp_path / "data"), "HOME": str(home)}
    return System(platform=platform, env=env, home=home, uid=501, python=PY, run=run, which=which,
                  probe=probe, sleep=lambda s: None, monotonic=lambda: float(next(clock)))


# --- templates ------------------------------------------------------------------


def test_the_templates_ship_in_the_package() -> None:
    # Package data (pyproject's [tool.setuptools.package-data]); test_install_tool.py renders them from a wheel.
    assert Path(svc.__file__).resolve().parents[2] / "deploy" == svc.DEPLOY_DIR  # mlxd/deploy
    assert sorted(p.name for p in svc.DEPLOY_DIR.glob("*.in")) == ["mlxd.plist.in", "mlxd.service.in"]


def test_plist_has_label_argv_keepalive_and_logs() -> None:
    opts = ServeOptions(host="::1", port=8900, config=Path("/c/a&b <x>.toml"), data_dir=Path("/d"))
    text = svc.render_plist(opts.service_argv(PY), opts.service_env(), svc.log_file(Path("/d")))
    plist = plistlib.loads(text.encode())
    assert plist["Label"] == "dev.mlxd"
    assert plist["ProgramArguments"] == [PY, "-m", "mlxd", "serve", "--host", "::1", "--port", "8900"]
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] is True
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == "/d/logs/mlxd.log"
    assert plist["EnvironmentVariables"] == {"MLXD_DATA_DIR": "/d", "MLXD_CONFIG": "/c/a&b <x>.toml"}
    assert plist["ExitTimeOut"] > 15
    assert plist["Umask"] == 0o077  # a log launchd re-creates is private


def test_plist_without_files_has_an_empty_environment() -> None:
    plist = plistlib.loads(svc.render_plist([PY, "-m", "mlxd", "serve"], {}, Path("/d/logs/mlxd.log")).encode())
    assert plist["EnvironmentVariables"] == {}
    assert plist["ProgramArguments"] == [PY, "-m", "mlxd", "serve"]


def test_unit_has_execstart_restart_stop_timeout_and_install() -> None:
    opts = ServeOptions(port=8900, config=Path("/c/my config.toml"), data_dir=Path("/d/100%"))
    unit = parse_unit(svc.render_unit(opts.service_argv(PY), opts.service_env(), Path("/d/logs/mlxd.log")))
    service = unit["Service"]
    assert service["ExecStart"] == '"/opt/py env/bin/python3" -m mlxd serve --port 8900'
    assert service["Restart"] == "on-failure"
    assert int(service["TimeoutStopSec"]) > 15
    assert service["KillMode"] == "mixed"
    assert service["StandardOutput"] == "append:/d/logs/mlxd.log"
    assert service["UMask"] == "0077"  # a log systemd re-creates is private
    assert unit["Install"]["WantedBy"] == "default.target"


@pytest.mark.parametrize("arg", ["plain", "two words", 'q"uote', "back\\slash", "100%", "$HOME", "a b $x %i \\ \""])
def test_systemd_quoting_round_trips(arg: str) -> None:
    line = " ".join(svc.systemd_quote(a) for a in [arg, "x", arg])
    assert svc.systemd_split(line) == [arg, "x", arg]


def test_the_unit_reads_back_its_options() -> None:
    opts = ServeOptions(host="0.0.0.0", port=9000, config=Path("/c/$odd %name.toml"), data_dir=Path("/d d"))
    text = svc.render_unit(opts.service_argv(PY), opts.service_env(), Path("/d d/logs/mlxd.log"))
    argv, env = svc.parse_unit(text)
    assert argv == opts.service_argv(PY)
    assert svc.options_from_argv(argv, env) == opts


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    opts = ServeOptions(port=8900, config=tmp_path / "c.toml", data_dir=tmp_path / "data dir")
    unit = tmp_path / "mlxd.service"
    unit.write_text(svc.render_unit(opts.service_argv(sys.executable), opts.service_env(), svc.log_file(tmp_path)))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "mlxd.service" not in out.stderr, out.stderr


# --- paths and pid files ---------------------------------------------------------


def test_paths(tmp_path: Path) -> None:
    assert svc.plist_path(Path("/h")) == Path("/h/Library/LaunchAgents/dev.mlxd.plist")
    assert svc.unit_path(Path("/h"), {}) == Path("/h/.config/systemd/user/mlxd.service")
    assert svc.unit_path(Path("/h"), {"XDG_CONFIG_HOME": "/x"}) == Path("/x/systemd/user/mlxd.service")
    assert svc.pid_file(Path("/d")) == Path("/d/mlxd.pid")
    assert svc.base_url("0.0.0.0", 1) == "http://127.0.0.1:1"
    assert svc.base_url("::", 1) == "http://[::1]:1"


def test_pid_file_round_trips_and_garbage_reads_as_none(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "mlxd.pid"
    record = svc.new_record(1234, "127.0.0.1", 8900)
    svc.write_pid_file(path, record)
    assert svc.read_pid_file(path) == record
    assert json.loads(path.read_text())["port"] == 8900
    path.write_text("{not json")
    assert svc.read_pid_file(path) is None
    svc.remove_pid_file(path)
    svc.remove_pid_file(path)
    assert svc.read_pid_file(path) is None


def test_a_pid_that_is_not_mlxd_is_stale(tmp_path: Path) -> None:
    path = svc.pid_file(tmp_path)
    svc.write_pid_file(path, svc.new_record(1, "127.0.0.1", 8900))  # pid 1 is not `mlxd serve`
    assert cmds.live_record(path) is None
    assert not path.exists()


def test_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "mlxd.log"
    assert "no log" in svc.log_tail(log)
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert svc.log_tail(log, 3) == "line 97\nline 98\nline 99"


# --- file modes ----------------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_fresh_data_dir_is_made_private_with_nothing_to_say(tmp_path: Path) -> None:
    data = tmp_path / "a" / "data"
    assert svc.secure_files(data) == []
    assert [mode(p) for p in (tmp_path / "a", data, data / "logs", svc.log_file(data))] == [0o700] * 3 + [0o600]
    svc.write_pid_file(svc.pid_file(data), svc.new_record(1234, "127.0.0.1", 8900))
    assert mode(svc.pid_file(data)) == 0o600


def test_an_older_layout_is_tightened_and_said_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "logs").mkdir(parents=True)
    data.chmod(0o755)  # the user's own dir, or an older mlxd's: left as it is
    (data / "logs").chmod(0o755)
    svc.log_file(data).write_text("old lines\n")
    svc.log_file(data).chmod(0o644)
    svc.pid_file(data).write_text("{}")
    svc.pid_file(data).chmod(0o644)
    assert svc.secure_files(data) == [
        f"note: {data}/logs was open to others (mode 755); made it 700",
        f"note: {data}/logs/mlxd.log was open to others (mode 644); made it 600",
        f"note: {data}/mlxd.pid was open to others (mode 644); made it 600",
    ]
    assert (mode(data), mode(data / "logs"), mode(svc.log_file(data)), mode(svc.pid_file(data))) == (
        0o755, 0o700, 0o600, 0o600,
    )
    assert svc.log_file(data).read_text() == "old lines\n"
    assert svc.secure_files(data) == []  # once


def test_a_data_dir_others_can_write_is_warned_about_every_time(tmp_path: Path) -> None:
    data = tmp_path / "my data"
    data.mkdir()
    data.chmod(0o775)
    warning = (f"warning: data dir {data} is writable by others (mode 775): they could replace mlxd's log "
               f"and pid file; run chmod go-w '{data}'")
    assert svc.secure_files(data) == [warning]
    assert svc.secure_files(data) == [warning]
    assert mode(data) == 0o775


def test_a_file_that_cannot_be_tightened_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "mlxd.log"
    log.write_text("")
    log.chmod(0o644)

    def refuse(self: Path, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(Path, "chmod", refuse)
    assert svc.tighten(log, 0o600) == f"warning: {log} is mode 644 and cannot be made private: Operation not permitted"
    assert svc.tighten(tmp_path / "missing", 0o600) is None


def test_the_pid_file_is_0600_even_over_a_loose_leftover_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "mlxd.pid"
    leftover = tmp_path / f".mlxd.pid.{os.getpid()}"
    leftover.write_text("half")
    leftover.chmod(0o666)
    svc.write_pid_file(path, svc.new_record(1234, "127.0.0.1", 8900))
    assert mode(path) == 0o600 and not leftover.exists()


def test_the_detached_daemon_log_is_created_0600(tmp_path: Path) -> None:
    log = tmp_path / "mlxd.log"
    proc = cmds.spawn_detached([sys.executable, "-c", "print('hello')"], log)
    assert proc.wait(30) == 0
    assert log.read_text() == "hello\n" and mode(log) == 0o600


# --- install / uninstall with a fake service manager -----------------------------


def test_install_on_linux_without_a_user_bus_prints_the_commands(tmp_path: Path) -> None:
    run = FakeOS({"systemctl --user show-environment": (1, "")})
    system = fake_system(tmp_path, "linux", run)
    lines = cmds.install_service(system, ServeOptions(port=8900))
    unit = tmp_path / "xdg/systemd/user/mlxd.service"
    assert lines[0] == f"wrote {unit}"
    assert "  systemctl --user enable --now mlxd" in lines
    service = parse_unit(unit.read_text())["Service"]
    assert service["Environment"] == f"MLXD_DATA_DIR={tmp_path}/data"  # carried from the shell's env
    # The log is there, private, before systemd's `append:` would create it 0644.
    assert [mode(tmp_path / p) for p in ("data", "data/logs", "data/logs/mlxd.log")] == [0o700, 0o700, 0o600]


def test_install_on_linux_with_a_user_bus_enables_and_starts(tmp_path: Path) -> None:
    run = FakeOS({"systemctl --user is-active": (3, "")})
    system = fake_system(tmp_path, "linux", run)
    lines = cmds.install_service(system, ServeOptions(port=8900))
    assert run.ran()[-2:] == ["systemctl --user daemon-reload", "systemctl --user enable --now mlxd"]
    assert "mlxd is running at http://127.0.0.1:8900" in lines[-1]


def test_install_with_no_which_systemctl_prints_the_commands(tmp_path: Path) -> None:
    run = FakeOS()
    lines = cmds.install_service(fake_system(tmp_path, "linux", run, which=lambda name: None), ServeOptions())
    assert run.calls == [] and "  systemctl --user daemon-reload" in lines


def test_install_on_macos_writes_the_agent_and_bootstraps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("rel.toml").write_text("[server]\nport = 8900\n")
    run = FakeOS({"launchctl print": (113, "")})
    system = fake_system(tmp_path, "darwin", run)
    cmds.install_service(system, ServeOptions(port=8900, config=Path("rel.toml")))
    plist_file = tmp_path / "home/Library/LaunchAgents/dev.mlxd.plist"
    plist = plistlib.loads(plist_file.read_bytes())
    assert plist["EnvironmentVariables"]["MLXD_CONFIG"] == str(Path("rel.toml").absolute())
    assert plist["StandardOutPath"] == f"{tmp_path}/data/logs/mlxd.log"
    assert mode(tmp_path / "data/logs/mlxd.log") == 0o600  # launchd would create it 0644
    assert run.ran()[-1] == f"launchctl bootstrap gui/501 {plist_file}"


def test_install_with_a_missing_config_file_is_refused(tmp_path: Path) -> None:
    system = fake_system(tmp_path, "darwin", FakeOS())
    with pytest.raises(cmds.click.ClickException, match="config file not found"):
        cmds.install_service(system, ServeOptions(config=tmp_path / "nope.toml"))
    assert not (tmp_path / "home/Library/LaunchAgents/dev.mlxd.plist").exists()


def test_install_reports_a_service_that_does_not_answer(tmp_path: Path) -> None:
    system = fake_system(tmp_path, "darwin", FakeOS({"launchctl print": (113, "")}), probe=lambda url: None)
    with pytest.raises(cmds.click.ClickException, match="did not answer"):
        cmds.install_service(system, ServeOptions())


def test_install_elsewhere_is_refused(tmp_path: Path) -> None:
    with pytest.raises(cmds.click.ClickException, match="supports macOS"):
        cmds.install_service(fake_system(tmp_path, "win32", FakeOS()), ServeOptions())


def test_uninstall_on_linux_disables_and_removes(tmp_path: Path) -> None:
    run = FakeOS()
    system = fake_system(tmp_path, "linux", run)
    cmds.install_service(system, ServeOptions())
    lines = cmds.uninstall_service(system)
    assert not (tmp_path / "xdg/systemd/user/mlxd.service").exists()
    assert "systemctl --user disable --now mlxd" in run.ran()
    assert run.ran()[-1] == "systemctl --user daemon-reload"
    assert lines[0].startswith("removed ")
    assert cmds.uninstall_service(system) == ["no mlxd service installed"]


def test_uninstall_on_macos_boots_out(tmp_path: Path) -> None:
    run = FakeOS()
    system = fake_system(tmp_path, "darwin", run)
    cmds.install_service(system, ServeOptions())
    cmds.uninstall_service(system)
    assert "launchctl bootout gui/501/dev.mlxd" in run.ran()
    assert not (tmp_path / "home/Library/LaunchAgents/dev.mlxd.plist").exists()


# --- start / stop / status through an installed service --------------------------


def installed(tmp_path: Path, platform: str, run: FakeOS, probe: Callable[[str], Any]) -> System:
    system = fake_system(tmp_path, platform, FakeOS())
    cmds.install_service(system, ServeOptions(port=8901))
    return fake_system(tmp_path, platform, run, probe=probe)


def test_start_through_systemd_waits_for_health(tmp_path: Path) -> None:
    answers = iter([None, None, HEALTH])
    run = FakeOS()
    system = installed(tmp_path, "linux", run, probe=lambda url: next(answers))
    assert "mlxd is running at http://127.0.0.1:8901" in cmds.start_daemon(system, ServeOptions())
    assert "systemctl --user start mlxd" in run.ran()


class LogModeAtStart(FakeOS):
    """Notes the log's mode (None: missing) when the service manager is told to start."""

    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log
        self.modes: list[int | None] = []

    def __call__(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        if argv[-2:] == ["start", "mlxd"] or argv[1:2] in (["kickstart"], ["bootstrap"]):
            self.modes.append(mode(self.log) if self.log.exists() else None)
        return super().__call__(argv)


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_start_through_a_service_makes_the_log_private_before_the_manager_opens_it(
    tmp_path: Path, platform: str, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "data/logs/mlxd.log"
    run = LogModeAtStart(log)
    system = installed(tmp_path, platform, run, probe=lambda url: HEALTH if run.modes else None)
    log.unlink()
    (tmp_path / "data/logs").chmod(0o755)
    capsys.readouterr()
    cmds.start_daemon(system, ServeOptions())
    assert run.modes == [0o600]
    assert mode(tmp_path / "data/logs") == 0o700
    assert capsys.readouterr().err == f"note: {tmp_path}/data/logs was open to others (mode 755); made it 700\n"


def test_start_through_launchd_kickstarts_a_loaded_agent_or_bootstraps(tmp_path: Path) -> None:
    answers = iter([None, HEALTH, None, HEALTH])
    run = FakeOS()
    system = installed(tmp_path, "darwin", run, probe=lambda url: next(answers))
    cmds.start_daemon(system, ServeOptions())
    assert run.ran()[-1] == "launchctl kickstart gui/501/dev.mlxd"
    run.replies["launchctl print"] = (113, "")
    cmds.start_daemon(system, ServeOptions())
    assert run.ran()[-1].startswith("launchctl bootstrap gui/501 ")


def test_start_through_a_service_that_never_answers_shows_the_log(tmp_path: Path) -> None:
    system = installed(tmp_path, "linux", FakeOS(), probe=lambda url: None)
    (tmp_path / "data/logs/mlxd.log").write_text("Traceback: it broke\n")
    with pytest.raises(cmds.click.ClickException, match=r"(?s)did not answer.*it broke"):
        cmds.start_daemon(system, ServeOptions())


def test_start_with_options_while_a_service_is_installed_is_refused(tmp_path: Path) -> None:
    system = installed(tmp_path, "linux", FakeOS(), probe=lambda url: HEALTH)
    with pytest.raises(cmds.click.ClickException, match="mlxd service install"):
        cmds.start_daemon(system, ServeOptions(port=1234))


def test_start_through_systemd_without_a_user_bus_says_so(tmp_path: Path) -> None:
    run = FakeOS({"systemctl --user show-environment": (1, "")})
    system = installed(tmp_path, "linux", run, probe=lambda url: None)
    with pytest.raises(cmds.click.ClickException, match="cannot reach a user manager"):
        cmds.start_daemon(system, ServeOptions())


def test_stop_through_systemd(tmp_path: Path) -> None:
    run = FakeOS()
    system = installed(tmp_path, "linux", run, probe=lambda url: None)
    assert cmds.stop_daemon(system, tmp_path / "data") == ["mlxd stopped (systemd user unit)"]
    assert run.ran()[-1] == "systemctl --user stop mlxd"
    run.replies["systemctl --user is-active"] = (3, "")
    assert cmds.stop_daemon(system, tmp_path / "data") == []


def test_status_through_launchd_reads_the_pid(tmp_path: Path) -> None:
    run = FakeOS({"launchctl print": (0, "gui/501/dev.mlxd = {\n\tstate = running\n\tpid = 4242\n}\n")})
    system = installed(tmp_path, "darwin", run, probe=lambda url: HEALTH)
    info = cmds.daemon_status(system, tmp_path / "data")
    assert info == {"status": "up", "url": "http://127.0.0.1:8901", "version": "0.1.0",
                    "engines": {"tiny": "ready"}, "pid": 4242, "managed_by": "launchd agent"}


# --- the click commands ------------------------------------------------------------


def test_status_command_exit_codes_and_output(tmp_path: Path) -> None:
    (tmp_path / "empty.toml").write_text("")
    env = {"MLXD_CONFIG": str(tmp_path / "empty.toml"), "MLXD_PORT": "8977"}
    up = fake_system(tmp_path, "linux", FakeOS(), probe=lambda url: HEALTH)
    up.env = {**up.env, **env}
    result = CliRunner().invoke(cmds.status, ["--data-dir", str(tmp_path / "d")], obj=up)
    assert result.exit_code == 0, result.output
    assert result.output == "mlxd is up at http://127.0.0.1:8977 (version 0.1.0)\nengines: tiny (ready)\n"
    down = fake_system(tmp_path, "linux", FakeOS(), probe=lambda url: None)
    down.env = {**down.env, **env}
    result = CliRunner().invoke(cmds.status, ["--json", "--data-dir", str(tmp_path / "d")], obj=down)
    assert result.exit_code == cmds.EXIT_DOWN
    assert json.loads(result.output)["status"] == "down"


def test_stop_command_when_nothing_runs(tmp_path: Path) -> None:
    system = fake_system(tmp_path, "linux", FakeOS(), probe=lambda url: None)
    result = CliRunner().invoke(cmds.stop, ["--data-dir", str(tmp_path / "d")], obj=system)
    assert result.exit_code == 0 and result.output == "mlxd is not running\n"


def test_the_group_has_install_and_uninstall() -> None:
    assert set(cmds.service.commands) == {"install", "uninstall"}
    assert [c.name for c in (cmds.start, cmds.stop, cmds.status, cmds.service)] == ["start", "stop", "status", "service"]
