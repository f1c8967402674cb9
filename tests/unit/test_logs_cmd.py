"""Log formatters (text, JSON) and `mlxd logs` over real files with a fake OS."""

from __future__ import annotations

import json
import logging
import os
import plistlib
import re
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxd.cli.service import logs_cmd
from mlxd.cli.service import spec as svc
from mlxd.cli.service.managers import System
from mlxd.cli.service.spec import ServeOptions
from mlxd.logformat import TEXT_FORMAT, JsonFormatter, iso_time, make_formatter

PY = "/opt/py/bin/python3"
ACCESS = {
    "method": "POST", "path": "/v1/chat/completions", "status": 200, "model": "tiny", "prompt_tokens": 12,
    "cached_tokens": 0, "completion_tokens": 5, "ttft_ms": 31.5, "tokens_per_s": 80.2, "duration_ms": 95.0,
}


def make_record(msg: str, *args: object, name: str = "mlxd.supervisor", level: int = logging.INFO, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def as_json(record: logging.LogRecord) -> dict[str, object]:
    line = JsonFormatter().format(record)
    assert "\n" not in line  # one object per line, whatever the message holds
    out = json.loads(line)
    assert isinstance(out, dict)
    return out


# --- formatters ------------------------------------------------------------------


def test_json_line_has_time_level_logger_and_the_rendered_message() -> None:
    record = make_record("mlxd serving on http://%s:%d/v1", "127.0.0.1", 8800)
    line = as_json(record)
    assert list(line) == ["ts", "level", "logger", "msg"]
    assert line["msg"] == "mlxd serving on http://127.0.0.1:8800/v1"
    assert line["level"] == "INFO" and line["logger"] == "mlxd.supervisor"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", str(line["ts"]))
    parsed = datetime.fromisoformat(str(line["ts"]).replace("Z", "+00:00"))
    assert abs(parsed.timestamp() - record.created) < 0.001


def test_iso_time_is_utc_with_milliseconds() -> None:
    assert iso_time(0.25) == "1970-01-01T00:00:00.250Z"
    assert iso_time(datetime(2025, 3, 4, 5, 6, 7, 891000, tzinfo=UTC).timestamp()) == "2025-03-04T05:06:07.891Z"


def test_json_line_carries_every_access_field() -> None:
    line = as_json(make_record("POST /v1/chat/completions 200 tiny 95 ms", name="mlxd.access", access=ACCESS))
    assert {key: line[key] for key in ACCESS} == ACCESS
    assert line["logger"] == "mlxd.access" and str(line["msg"]).startswith("POST")


def test_access_fields_never_replace_the_line_s_own_and_odd_values_become_strings() -> None:
    odd = {"msg": "not this", "level": "nope", "duration_ms": None, "when": datetime(2025, 1, 1, tzinfo=UTC)}
    line = as_json(make_record("the real message", access=odd))
    assert line["msg"] == "the real message" and line["level"] == "INFO"
    assert line["duration_ms"] is None
    assert line["when"] == "2025-01-01 00:00:00+00:00"


def test_json_line_includes_the_traceback() -> None:
    try:
        raise RuntimeError("engine went away")
    except RuntimeError:
        record = make_record("relay failed", level=logging.ERROR, exc_info=sys.exc_info())
    line = as_json(record)
    assert line["level"] == "ERROR"
    assert "Traceback (most recent call last)" in str(line["exc"])
    assert "RuntimeError: engine went away" in str(line["exc"])


def test_a_relayed_engine_line_keeps_its_own_level_and_logger_and_names_its_model() -> None:
    line = as_json(make_record("[%s] %s", "qwen3-4b", "WARNING mlxd.engine.gpu: slow step\nsecond line"))
    assert line == {**line, "level": "WARNING", "logger": "mlxd.engine.gpu", "msg": "slow step\nsecond line",
                    "model": "qwen3-4b"}


def test_a_line_about_an_engine_names_its_model() -> None:
    line = as_json(make_record("[%s] engine failed to start: %s", "tiny", "exit 1", level=logging.ERROR))
    assert (line["level"], line["logger"], line["msg"], line["model"]) == ("ERROR", "mlxd.supervisor", "engine failed to start: exit 1", "tiny")
    crash = as_json(make_record("[tiny] Traceback (most recent call last):"))  # an engine's stderr, not a log line
    assert (line["logger"], crash["msg"], crash["model"]) == ("mlxd.supervisor", "Traceback (most recent call last):", "tiny")
    assert "model" not in as_json(make_record("[not a model name] x"))


def test_text_format_is_the_classic_line() -> None:
    record = make_record("hello %s", "there", name="mlxd.config", level=logging.WARNING)
    text = make_formatter("text").format(record)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING mlxd\.config: hello there", text)
    assert TEXT_FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s"
    with pytest.raises(ValueError, match="text, json"):
        make_formatter("xml")


# --- carrying --log-format into the service ----------------------------------------


def test_log_format_travels_in_the_service_env_and_reads_back() -> None:
    opts = svc.from_env(ServeOptions(port=8900), {"MLXD_LOG_FORMAT": "json"})
    assert opts.log_format == "json"
    unit = svc.render_unit(opts.service_argv(PY), opts.service_env(), Path("/d/logs/mlxd.log"))
    assert "Environment=MLXD_LOG_FORMAT=json" in unit.splitlines()
    argv, env = svc.parse_unit(unit)
    assert svc.options_from_argv(argv, env) == opts
    plist = plistlib.loads(svc.render_plist(opts.service_argv(PY), opts.service_env(), Path("/l")).encode())
    assert plist["EnvironmentVariables"] == {"MLXD_LOG_FORMAT": "json"}
    assert ServeOptions().service_env() == {}


def test_the_log_format_option_exports_itself_for_the_daemon() -> None:
    import click

    from mlxd.cli.options import serve_options

    @click.command()
    @serve_options
    def probe(**kwargs: object) -> None:
        click.echo(os.environ.get("MLXD_LOG_FORMAT"))

    runner = CliRunner()
    assert runner.invoke(probe, ["--log-format", "JSON"], env={"MLXD_LOG_FORMAT": None}).output == "json\n"
    assert runner.invoke(probe, [], env={"MLXD_LOG_FORMAT": "text"}).output == "text\n"
    bad = runner.invoke(probe, [], env={"MLXD_LOG_FORMAT": "xml"})
    assert bad.exit_code == 2 and "Invalid value for $MLXD_LOG_FORMAT: 'xml' is not one of text, json" in bad.output


# --- finding and printing the log ------------------------------------------------


def fake_system(tmp_path: Path, platform: str = "linux", *, run_attached: Callable[[list[str]], int] | None = None,
                sleep: Callable[[float], None] = lambda s: None) -> System:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HOME": str(home)}
    return System(platform=platform, env=env, home=home, uid=501, python=PY, which=lambda name: f"/usr/bin/{name}",
                  probe=lambda url: None, sleep=sleep, run_attached=run_attached or (lambda argv: 0))


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default data dir (no --data-dir): its log is where `mlxd start` writes."""
    monkeypatch.setenv("MLXD_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def write_log(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def mlxd_logs(system: System, *args: str) -> subprocess.CompletedProcess[str]:
    result = CliRunner().invoke(logs_cmd.logs, list(args), obj=system)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def test_never_started_is_one_clear_line(tmp_path: Path, data: Path) -> None:
    out = mlxd_logs(fake_system(tmp_path))
    assert out.returncode == 1
    assert out.stderr == (f"Error: no mlxd log at {data}/logs/mlxd.log: mlxd has not run in the background here "
                          "(`mlxd start` runs it; `mlxd serve` logs to its own terminal)\n")


def test_prints_the_last_lines_of_the_data_dir_log(tmp_path: Path, data: Path) -> None:
    write_log(svc.log_file(data), "".join(f"line {i}\n" for i in range(300)))
    out = mlxd_logs(fake_system(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"line {i}" for i in range(200, 300)]
    assert mlxd_logs(fake_system(tmp_path), "-n", "2").stdout == "line 298\nline 299\n"
    assert mlxd_logs(fake_system(tmp_path), "--lines", "0").stdout == ""


def test_an_explicit_data_dir_wins_over_the_service(tmp_path: Path, data: Path) -> None:
    other = tmp_path / "other"
    write_log(svc.log_file(other), "from the other data dir\n")
    install_unit(tmp_path, "StandardOutput=append:/nowhere/mlxd.log")
    out = mlxd_logs(fake_system(tmp_path), "--data-dir", str(other))
    assert out.stdout == "from the other data dir\n"
    missing = mlxd_logs(fake_system(tmp_path), "--data-dir", str(tmp_path / "nope"))
    assert missing.returncode == 1
    assert f"no mlxd log at {tmp_path}/nope/logs/mlxd.log: mlxd has not run with data dir" in missing.stderr


def install_unit(tmp_path: Path, output_line: str) -> Path:
    unit = svc.unit_path(tmp_path / "home", {"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(f"[Service]\nExecStart={PY} -m mlxd serve\n{output_line}\n")
    return unit


def test_the_systemd_unit_s_log_file(tmp_path: Path, data: Path) -> None:
    log = write_log(tmp_path / "svc 100%" / "mlxd.log", "from the unit\n")
    install_unit(tmp_path, f"StandardOutput=append:{str(log).replace('%', '%%')}")
    write_log(svc.log_file(data), "an older mlxd start\n")
    assert mlxd_logs(fake_system(tmp_path)).stdout == "from the unit\n"


def test_a_unit_logging_to_the_journal_is_read_with_journalctl(tmp_path: Path, data: Path) -> None:
    install_unit(tmp_path, "StandardOutput=journal")
    ran: list[list[str]] = []

    def journalctl(argv: list[str]) -> int:
        ran.append(argv)
        return 0

    out = mlxd_logs(fake_system(tmp_path, run_attached=journalctl), "-f", "-n", "5")
    assert out.returncode == 0, out.stderr
    assert ran == [["journalctl", "--user", "-u", "mlxd.service", "-o", "cat", "-n", "5", "-f"]]
    missing = mlxd_logs(fake_system(tmp_path, run_attached=lambda argv: 127))
    assert missing.returncode == 1 and "`journalctl` is not installed" in missing.stderr


def test_the_launchd_agent_s_log_file(tmp_path: Path, data: Path) -> None:
    log = write_log(tmp_path / "agent.log", "from the agent\n")
    plist = svc.plist_path(tmp_path / "home")
    plist.parent.mkdir(parents=True)
    plist.write_text(svc.render_plist([PY, "-m", "mlxd", "serve"], {}, log))
    assert mlxd_logs(fake_system(tmp_path, "darwin")).stdout == "from the agent\n"
    plist.write_text("not a plist")
    broken = mlxd_logs(fake_system(tmp_path, "darwin"))
    assert broken.returncode == 1 and f"cannot read the launchd agent {plist}" in broken.stderr


def test_an_unreadable_log_is_one_line(tmp_path: Path, data: Path) -> None:
    svc.log_file(data).mkdir(parents=True)  # a dir where the file should be: unreadable even as root
    out = mlxd_logs(fake_system(tmp_path))
    assert out.returncode == 1
    assert out.stderr == f"Error: cannot read mlxd's log {svc.log_file(data)}: Is a directory\n"


def test_an_empty_log_says_so_on_stderr(tmp_path: Path, data: Path) -> None:
    write_log(svc.log_file(data), "")
    out = mlxd_logs(fake_system(tmp_path))
    assert out.returncode == 0 and out.stdout == ""
    assert out.stderr == f"({svc.log_file(data)} is empty)\n"


def test_tail_reads_back_across_blocks_and_keeps_a_last_partial_line(tmp_path: Path) -> None:
    lines = [f"{i:06d} " + "x" * 200 for i in range(2000)]  # ~400 KiB: several blocks
    path = write_log(tmp_path / "big.log", "\n".join(lines))  # no newline at the end
    with path.open("rb") as f:
        assert logs_cmd.tail_lines(f, 700).decode().split("\n") == lines[-700:]
        assert f.tell() == path.stat().st_size
        assert logs_cmd.tail_lines(f, 5000).decode().split("\n") == lines


def test_follow_prints_appends_and_survives_truncation_and_rotation(tmp_path: Path, data: Path) -> None:
    log = write_log(svc.log_file(data), "old\n")

    def append(text: str) -> None:
        with log.open("a") as f:
            f.write(text)

    steps: list[Callable[[], object]] = [
        lambda: append("one\n"),
        lambda: log.write_text("cut\n"),  # shorter than what was read: seen as truncated
        lambda: log.rename(log.with_suffix(".1")),  # rotated: for a while there is no log
        lambda: write_log(log, "after rotation\n"),
        lambda: append("two\n"),
    ]

    def sleep(seconds: float) -> None:
        if not steps:
            raise KeyboardInterrupt  # Ctrl-C: the way -f ends
        steps.pop(0)()

    out = mlxd_logs(fake_system(tmp_path, sleep=sleep), "-f")
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout == "old\none\ncut\nafter rotation\ntwo\n"
