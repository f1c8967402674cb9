"""`mlxd models|ps|load|unload|drain|lease` without a daemon: formatting, addresses, keys, errors."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from mlxd.cli.admin import cmds, tables
from mlxd.cli.admin.client import (
    AdminClient,
    HTTPFailure,
    Unreachable,
    error_from_response,
    normalize_url,
    resolve_key,
)
from mlxd.cli.main import main
from mlxd.cli.service.managers import System

ENGINES: dict[str, Any] = {
    "object": "list", "budget_bytes": 12_000_000_000, "used_bytes": 1_234_000_000, "max_loaded": 2,
    "data": [
        {"model": "tiny", "state": "ready", "pid": 4242, "uptime_s": 12.5, "rss_bytes": 540_000_000,
         "memory_estimate_bytes": 500_000_000, "in_flight": 1, "queued": 3, "last_used": 1.0e9,
         "batch": "auto", "width": 32, "kv_budget_tokens": 131072, "sizing": "batch auto: 32 (the most on cpu)",
         "pinned": False, "restarts": 0, "idle_ttl_s": 300, "expires_in_s": 245.0, "failure": None,
         "lease": {"id": "l-1", "holder": "mlxd lease: python bench.py --long-flag", "expires_at": 2.0e9},
         "prompt_cache": {"ram": {"entries": 2, "bytes": 48_000_000}, "ssd": {"entries": 9, "bytes": 1_200_000_000},
                          "hits": {"ram": 2, "ssd": 1}, "misses": 1}},
        {"model": "SmolLM2-135M-Instruct", "state": "ready", "pid": 77, "uptime_s": 3.0, "rss_bytes": None,
         "memory_estimate_bytes": 4_700_000_000, "in_flight": 0, "queued": 0, "last_used": None, "batch": 8,
         "width": 8,
         "pinned": True, "restarts": 1, "idle_ttl_s": 300, "expires_in_s": None, "failure": None, "lease": None},
        {"model": "gone", "state": "stopped", "pid": None, "uptime_s": None, "rss_bytes": None,
         "memory_estimate_bytes": 1, "in_flight": 0, "queued": 0, "last_used": None, "pinned": False,
         "restarts": 0, "idle_ttl_s": 300, "expires_in_s": None, "failure": None, "lease": None},
        {"model": "broken", "state": "failed", "pid": None, "uptime_s": None, "rss_bytes": None,
         "memory_estimate_bytes": 2_000, "in_flight": 0, "queued": 0, "last_used": None, "pinned": False,
         "restarts": 5, "idle_ttl_s": -1, "expires_in_s": None, "failure": "unsupported model type 'xyz'",
         "lease": None, "retry_in_s": 11.2},
    ],
}


# --- formatting ------------------------------------------------------------------


@pytest.mark.parametrize(("num_bytes", "text"), [
    (None, "-"), (0, "0 B"), (999, "999 B"), (1000, "1.0 KB"), (540_000_000, "540 MB"),
    (4_700_000_000, "4.7 GB"), (12_000_000_000, "12 GB"), (999_999, "1000 KB"), (3 * 10**15, "3000 TB"),
])
def test_format_size_uses_decimal_units(num_bytes: int | None, text: str) -> None:
    assert tables.format_size(num_bytes) == text


@pytest.mark.parametrize(("ms", "text"), [(None, "-"), (0.4, "0 ms"), (850, "850 ms"), (1320, "1.3 s"),
                                          (125_000, "2 min 5 s")])
def test_format_ms(ms: float | None, text: str) -> None:
    assert tables.format_ms(ms) == text


@pytest.mark.parametrize(("delta", "text"), [
    (0.4, "now"), (-0.2, "now"), (1, "1 second from now"), (45.9, "45 seconds from now"),
    (60, "1 minute from now"), (245, "4 minutes from now"), (-180, "3 minutes ago"),
    (-7300, "2 hours ago"), (3 * 86400 + 5, "3 days from now"),
])
def test_relative_time(delta: float, text: str) -> None:
    assert tables.relative_time(delta) == text


def test_render_table_aligns_columns_without_trailing_blanks() -> None:
    text = tables.render_table(("NAME", "SIZE"), [("a", "1 B"), ("longer-name", "")])
    assert text.splitlines() == ["NAME          SIZE", "a             1 B", "longer-name"]


def test_ps_shows_only_engines_that_are_not_stopped() -> None:
    assert [e["model"] for e in tables.running_engines(ENGINES)] == ["tiny", "SmolLM2-135M-Instruct", "broken"]
    assert tables.running_engines({"data": []}) == []


def test_ps_table() -> None:
    lines = tables.ps_text(ENGINES).splitlines()
    assert lines[0].split() == ["NAME", "STATE", "SIZE", "RSS", "PID", "BATCH", "IN", "FLIGHT", "QUEUED", "PROMPT",
                                "CACHE", "UNTIL", "LEASE"]
    tiny, smol, broken = lines[1:4]
    assert tiny.split()[:11] == ["tiny", "ready", "500", "MB", "540", "MB", "4242", "32", "(auto)", "1", "3"]
    assert "48 MB + 1.2 GB SSD, 75% hit" in tiny
    assert lines[0].index("PROMPT CACHE") == tiny.index("48 MB") == smol.index("-  ", lines[0].index("PROMPT"))
    assert "4 minutes from now" in tiny and tiny.endswith("   mlxd lease: python bench.py…")
    assert smol.split()[:7] == ["SmolLM2-135M-Instruct", "ready", "4.7", "GB", "-", "77", "8"]
    assert broken.split()[6] == "-"  # no width known
    assert smol.split()[-2:] == ["pinned", "-"]
    assert broken.split()[:2] == ["broken", "failed"] and broken.split()[-2:] == ["forever", "-"]
    assert "gone" not in tables.ps_text(ENGINES)
    assert lines[4] == "broken failed: unsupported model type 'xyz'; retried in 12 s (`mlxd load broken` retries now)"
    assert lines[5] == "memory: 1.2 GB of 12 GB budget in use, at most 2 models loaded"
    # Every row's columns start where the header's do.
    header = lines[0]
    assert header.index("STATE") == tiny.index("ready") == smol.index("ready") == broken.index("failed")
    assert header.index("UNTIL") == tiny.index("4 minutes") == smol.index("pinned") == broken.index("forever")
    assert header.index("LEASE") == tiny.index("mlxd lease") == len(smol) - 1


def test_ps_with_nothing_loaded_and_no_cap() -> None:
    listing = {"budget_bytes": 8_000_000_000, "used_bytes": 0, "max_loaded": None, "data": [ENGINES["data"][2]]}
    assert tables.ps_text(listing) == "no models loaded\nmemory: 0 B of 8.0 GB budget in use"
    assert tables.budget_line({"budget_bytes": 0, "used_bytes": 5, "max_loaded": 1}) == \
        "memory: 5 B in use (no budget), at most 1 model loaded"
    assert tables.budget_line({"budget_bytes": 10**9, "used_bytes": 0, "machine_leased": True}).endswith(
        "budget in use; the machine is leased (mlxd lease --all)")


def test_until_column() -> None:
    assert tables.until_text({"pinned": True, "expires_in_s": 10}) == "pinned"
    assert tables.until_text({"pinned": False, "expires_in_s": None, "idle_ttl_s": -1}) == "forever"
    assert tables.until_text({"pinned": False, "expires_in_s": None, "idle_ttl_s": 300}) == "-"
    assert tables.until_text({"pinned": False, "expires_in_s": -3}) == "now"
    assert tables.until_text({"pinned": False, "expires_in_s": 3600}) == "1 hour from now"


def test_models_table() -> None:
    listing = {"data": [
        {"id": "tiny", "size_bytes": 1_500_000, "source": "config", "state": "ready", "loaded": True,
         "context_window": 2048, "capabilities": ["completion"]},
        {"id": "mlx-community/Qwen3-VL-4B-4bit", "size_bytes": 2_260_000_000, "source": "hf_cache",
         "state": "stopped", "loaded": False, "context_window": 262144,
         "capabilities": ["completion", "vision", "tools", "reasoning"]},
        {"id": "old", "size_bytes": 1, "source": "config", "state": "stopped"},  # a supervisor before capabilities
    ]}
    lines = tables.models_text(listing).splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "CONTEXT", "TAKES", "SOURCE", "STATE"]
    assert lines[1].split() == ["tiny", "1.5", "MB", "2K", "-", "config", "ready"]
    assert lines[2].split() == ["mlx-community/Qwen3-VL-4B-4bit", "2.3", "GB", "256K", "vision,tools,reasoning",
                                "hf_cache", "stopped"]
    assert lines[3].split() == ["old", "1", "B", "-", "-", "config", "stopped"]
    assert "no models found" in tables.models_text({"data": []})


def test_load_unload_drain_text() -> None:
    assert tables.load_text({"model": "tiny", "state": "ready", "pinned": True, "load_ms": 1320.0}) == \
        "tiny is ready (loaded in 1.3 s, pinned)"
    assert tables.unload_text({"model": "tiny", "was_loaded": False, "drain": None}) == "tiny was not loaded"
    drained = {"model": "tiny", "was_loaded": True, "drain": {"finished": 2, "cancelled": 0}}
    assert tables.unload_text(drained) == "tiny unloaded (2 finished)"
    result = {"drained": [{"model": "tiny", "finished": 2, "cancelled": 1, "waited_ms": 850.0,
                           "cache_written_bytes": 12_300_000}]}
    lines = tables.drain_text(result).splitlines()
    assert lines[0].split() == ["NAME", "FINISHED", "CANCELLED", "WAITED", "CACHE", "WRITTEN"]
    assert lines[1].split() == ["tiny", "2", "1", "850", "ms", "12", "MB"]
    assert tables.drain_text({"drained": []}) == "nothing to drain (no models loaded)"


# --- addresses and keys ----------------------------------------------------------


@pytest.mark.parametrize(("url", "normal"), [
    ("http://127.0.0.1:8800/", "http://127.0.0.1:8800"), ("localhost:9000", "http://localhost:9000"),
    ("https://box.local/mlxd/", "https://box.local/mlxd"), ("http://[::1]:8800", "http://[::1]:8800"),
])
def test_normalize_url(url: str, normal: str) -> None:
    assert normalize_url(url) == normal


@pytest.mark.parametrize("url", ["ftp://x:1", "http://", "http://h:99999", "http://h:port"])
def test_normalize_url_refuses_what_is_not_http(url: str) -> None:
    with pytest.raises(ValueError):
        normalize_url(url)


def system_with(tmp_path: Path, **env: str) -> System:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return System(platform="linux", env={"XDG_CONFIG_HOME": str(tmp_path / "xdg"), **env}, home=home)


def test_url_flag_beats_env_beats_config(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[server]\nport = 9123\n")
    data = tmp_path / "data"
    system = system_with(tmp_path, MLXD_URL="http://10.0.0.5:7000/", MLXD_CONFIG=str(config))
    assert cmds.resolve_url("http://h:1", None, data, system) == "http://h:1"
    assert cmds.resolve_url(None, None, data, system) == "http://10.0.0.5:7000"
    assert cmds.resolve_url(None, None, data, system_with(tmp_path, MLXD_CONFIG=str(config))) == \
        "http://127.0.0.1:9123"
    assert cmds.resolve_url(None, config, data, system_with(tmp_path, MLXD_PORT="9999")) == "http://127.0.0.1:9999"
    wildcard = tmp_path / "w.toml"
    wildcard.write_text('[server]\nhost = "0.0.0.0"\nport = 8811\n')
    assert cmds.resolve_url(None, wildcard, data, system_with(tmp_path)) == "http://127.0.0.1:8811"


def test_a_stale_pid_file_is_ignored_for_the_address(tmp_path: Path) -> None:
    from mlxd.cli.service import spec as svc

    data = tmp_path / "data"
    svc.write_pid_file(svc.pid_file(data), svc.new_record(2**22 + 12345, "127.0.0.1", 9555))
    config = tmp_path / "c.toml"
    config.write_text("[server]\nport = 9124\n")
    assert cmds.resolve_url(None, None, data, system_with(tmp_path, MLXD_CONFIG=str(config))) == \
        "http://127.0.0.1:9124"


def test_a_bad_url_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(click.UsageError, match=r"\$MLXD_URL: not an http"):
        cmds.resolve_url(None, None, None, system_with(tmp_path, MLXD_URL="ftp://x"))
    with pytest.raises(click.UsageError, match="--url: bad port"):
        cmds.resolve_url("http://h:x", None, None, system_with(tmp_path))


def test_a_bad_config_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nprot = 1\n")
    with pytest.raises(click.ClickException, match=r"did you mean 'server\.port'"):
        cmds.resolve_url(None, config, tmp_path, system_with(tmp_path))


def test_admin_key_beats_api_key() -> None:
    assert resolve_key({"MLXD_ADMIN_KEY": "adm", "MLXD_API_KEY": "api"}) == ("adm", "MLXD_ADMIN_KEY")
    assert resolve_key({"MLXD_ADMIN_KEY": " ", "MLXD_API_KEY": "api"}) == ("api", "MLXD_API_KEY")
    assert resolve_key({}) == (None, None)


def test_the_key_goes_in_a_bearer_header() -> None:
    client = AdminClient("http://127.0.0.1:1", "sekret", "MLXD_ADMIN_KEY")
    headers = client._headers(b"{}")
    assert headers["Authorization"] == "Bearer sekret" and headers["Content-Type"] == "application/json"
    assert "Authorization" not in AdminClient("http://127.0.0.1:1")._headers(None)


# --- errors ----------------------------------------------------------------------


def test_an_openai_error_body_gives_the_servers_message() -> None:
    body = json.dumps({"error": {"message": "model 'x' is pinned", "type": "invalid_request_error",
                                 "param": "model", "code": "model_pinned"}}).encode()
    err = error_from_response(409, "Conflict", body)
    assert (err.status, err.message, err.code, err.param) == (409, "model 'x' is pinned", "model_pinned", "model")


def test_an_error_that_is_not_json_is_summed_up() -> None:
    err = error_from_response(502, "Bad Gateway", b"<html>\n<body>nginx</body></html>")
    assert err.message == "HTTP 502 Bad Gateway: <html>" and err.code is None
    assert error_from_response(500, "Internal Server Error", b"").message == "HTTP 500 Internal Server Error"


def test_unreachable_messages() -> None:
    assert str(Unreachable("http://127.0.0.1:8800", ConnectionRefusedError(111, "Connection refused"))) == \
        "mlxd is not running at http://127.0.0.1:8800 (start it with `mlxd start`)"
    assert str(Unreachable("http://nohost:1", OSError(-2, "Name or service not known"))) == \
        "cannot reach mlxd at http://nohost:1: Name or service not known"


def test_a_401_says_to_set_the_admin_key() -> None:
    err = HTTPFailure(401, "Missing or invalid API key.", code="invalid_api_key")
    without = cmds.describe_failure(err, AdminClient("http://h:1"))
    assert "set MLXD_ADMIN_KEY" in without and "Missing or invalid API key." in without
    refused = cmds.describe_failure(err, AdminClient("http://h:1", "k", "MLXD_API_KEY"))
    assert refused.startswith("mlxd at http://h:1 refused the key in $MLXD_API_KEY: set MLXD_ADMIN_KEY")


def test_a_known_code_adds_its_hint() -> None:
    err = HTTPFailure(409, "model 'tiny' is pinned", code="model_pinned")
    hints = {"model_pinned": ("--force", "use --force")}
    assert cmds.describe_failure(err, AdminClient("http://h:1"), hints) == "model 'tiny' is pinned\nuse --force"
    named = HTTPFailure(409, "Model tiny is pinned; unload it with `mlxd unload --force`.", code="model_pinned")
    assert cmds.describe_failure(named, AdminClient("http://h:1"), hints) == named.message
    assert cmds.describe_failure(HTTPFailure(503, "load failed", code="model_load_failed"),
                                 AdminClient("http://h:1"), hints) == "load failed"


# --- lease: arguments, signals, exit codes --------------------------------------


def test_lease_arguments(tmp_path: Path) -> None:
    runner = CliRunner()
    cases = [
        (["lease", "tiny"], "missing COMMAND"), (["lease", "--", "true"], "give the MODEL"),
        (["lease", "--all", "tiny", "--", "true"], "not both"), (["lease", "tiny", "extra", "--", "true"], "extra"),
        (["lease", "tiny", "--ttl", "0", "--", "true"], "--ttl"),
    ]
    for args, message in cases:
        result = runner.invoke(main, args, obj=system_with(tmp_path))
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output


def test_lease_request_body() -> None:
    body = cmds.lease_request("tiny", False, ["python", "-c", "print('hi there')"], 30.0, None)
    assert body == {"model": "tiny", "ttl_s": 30.0, "holder": "mlxd lease: python -c 'print('\"'\"'hi there'\"'\"')'"}
    assert cmds.lease_request(None, True, ["x"], 5.0, "bench")["model"] is None
    assert len(cmds.lease_request("m", False, ["y" * 500], 5.0, None)["holder"]) == cmds.HOLDER_MAX_CHARS


def test_lease_command_after_the_double_dash_is_kept_whole() -> None:
    ctx = click.Context(cmds.lease)
    rest = cmds.lease.parse_args(ctx, ["tiny", "--ttl", "5", "--", "python", "--ttl", "-c", "--", "x"])
    assert rest == []
    assert ctx.meta["mlxd.lease_command"] == ["python", "--ttl", "-c", "--", "x"]
    assert ctx.params["model"] == "tiny" and ctx.params["ttl_s"] == 5.0


def test_exit_status_follows_the_shell() -> None:
    assert cmds.exit_status(0) == 0 and cmds.exit_status(3) == 3
    assert cmds.exit_status(-signal.SIGTERM) == 143 and cmds.exit_status(-signal.SIGKILL) == 137


def test_sigint_from_the_terminal_is_not_sent_twice() -> None:
    assert cmds.should_forward(signal.SIGINT, lambda: False)
    assert not cmds.should_forward(signal.SIGINT, lambda: True)
    assert cmds.should_forward(signal.SIGTERM, lambda: True) and cmds.should_forward(signal.SIGHUP, lambda: True)


def test_lease_paths_quote_the_id() -> None:
    assert cmds.lease_path("a/b c", "/renew") == "/admin/leases/a%2Fb%20c/renew"


class FakeProc:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def send_signal(self, signum: int) -> None:
        self.sent.append(signum)


def test_a_signal_during_the_childs_start_reaches_it_once() -> None:
    forwarder = cmds.Forwarder()
    forwarder(signal.SIGTERM, None)  # before the child exists: only noted
    proc = FakeProc()
    forwarder.attach(proc)  # type: ignore[arg-type]
    assert proc.sent == [signal.SIGTERM]
    forwarder(signal.SIGHUP, None)
    assert proc.sent == [signal.SIGTERM, signal.SIGHUP]
    later = cmds.Forwarder()
    later.attach(proc)  # type: ignore[arg-type]
    assert proc.sent == [signal.SIGTERM, signal.SIGHUP]


def test_load_sends_pin_only_when_asked() -> None:
    assert cmds.load_body("tiny", None) == {"model": "tiny"}
    assert cmds.load_body("tiny", True) == {"model": "tiny", "pin": True}
    assert cmds.load_body("tiny", False) == {"model": "tiny", "pin": False}
    ctx = click.Context(cmds.load)
    cmds.load.parse_args(ctx, ["tiny", "--no-pin"])
    assert ctx.params["pin"] is False
    ctx = click.Context(cmds.load)
    cmds.load.parse_args(ctx, ["tiny"])
    assert ctx.params["pin"] is None


def test_prompt_cache_column() -> None:
    assert tables.cache_text(None) == "-"
    assert tables.cache_text({"ram": {"bytes": 5}, "ssd": None, "hits": {"ram": 0, "ssd": 0}, "misses": 0}) == "5 B"
    assert tables.cache_text({"ram": {"bytes": 0}, "ssd": {"bytes": 0}, "hits": {"ram": 0}, "misses": 3}) == \
        "0 B + 0 B SSD, 0% hit"
