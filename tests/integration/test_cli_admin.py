"""`mlxd models|ps|load|unload|drain|lease` as real processes against a real supervisor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import SupervisorProcess, cli_env, free_port, mlxd, serving, wait_for

ADMIN_KEY = "admin-sekret"
PRINT_LEASE = "import os; print('lease', os.environ['MLXD_LEASE_ID'], os.environ['MLXD_URL'])"
# Asks for two tokens with the lease header; prints the status and the number of tokens.
LEASED_REQUEST = """\
import json, os, urllib.request
body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
req = urllib.request.Request(os.environ["MLXD_URL"] + "/v1/completions", data=body, headers={
    "Content-Type": "application/json", "X-MLXD-Lease": os.environ["MLXD_LEASE_ID"]})
with urllib.request.urlopen(req, timeout=60) as resp:
    print("status", resp.status, json.load(resp)["usage"]["completion_tokens"], flush=True)
"""
WAIT_FOR_SIGNAL = "import os, time; print('ready', os.environ['MLXD_LEASE_ID'], flush=True); time.sleep(120)"


def spawn_lease(url: str, *args: str) -> subprocess.Popen[str]:
    """`mlxd lease` in its own session (no terminal: SIGINT is forwarded, not sent by a tty)."""
    argv = [sys.executable, "-m", "mlxd", "lease", "--url", url, *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            start_new_session=True)


def read_ready(proc: subprocess.Popen[str]) -> str:
    """The lease id from the command's `ready LEASE_ID` line."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready "), line + (proc.stderr.read() if proc.stderr else "")
    return line.split()[1]


def kill_session(proc: subprocess.Popen[str]) -> None:
    """SIGKILL `mlxd lease` and its command (they share a session) if still there."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def sup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    with serving(tiny_model, "tiny", tmp_path_factory.mktemp("sup")) as proc:
        yield proc


def lease_record(sup: SupervisorProcess, lease_id: str) -> dict[str, Any]:
    """The lease as `GET /admin/leases` lists it."""
    resp = sup.client.get("/admin/leases")
    assert resp.status_code == 200, resp.text
    [record] = [item for item in resp.json()["data"] if item["id"] == lease_id]
    return record  # type: ignore[no-any-return]


def wait_lease_ended(sup: SupervisorProcess, lease_id: str, timeout: float = 15) -> dict[str, Any]:
    wait_for(lambda: lease_record(sup, lease_id)["state"] == "ended", timeout, interval=0.1,
             message=lambda: f"the lease did not end: {lease_record(sup, lease_id)}")
    return lease_record(sup, lease_id)


def ps_rows(sup: SupervisorProcess) -> dict[str, list[str]]:
    """`mlxd ps` as {name: the row's words}."""
    out = mlxd("ps", "--url", sup.url)
    assert out.returncode == 0, out.stderr
    return {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:-1] if line.strip()}


# --- no daemon needed --------------------------------------------------------------


def test_ps_where_nothing_listens_is_one_line_and_exit_1() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for env in (cli_env(), cli_env(MLXD_URL=url)):
        out = mlxd("ps", *(() if "MLXD_URL" in env else ("--url", url)), env=env)
        assert out.returncode == 1
        assert out.stdout == ""
        assert out.stderr == f"Error: mlxd is not running at {url} (start it with `mlxd start`)\n"


def test_the_address_comes_from_the_config_file(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "c.toml"
    config.write_text(f"[server]\nport = {port}\n")
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(HOME=str(home), XDG_CONFIG_HOME=str(tmp_path / "xdg"), MLXD_DATA_DIR=str(tmp_path / "data"))
    for args, extra in ((("--config", str(config)), {}), ((), {"MLXD_CONFIG": str(config)})):
        out = mlxd("models", *args, env={**env, **extra})
        assert out.returncode == 1
        assert f"mlxd is not running at http://127.0.0.1:{port} " in out.stderr


def test_the_cli_imports_neither_aiohttp_nor_mlx(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f"[server]\nport = {free_port()}\n")
    script = (
        "import sys\nfrom mlxd.cli.main import main\n"
        f"try:\n    main(['ps', '--config', {str(config)!r}])\nexcept SystemExit as exc:\n    assert exc.code == 1\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'mlx', 'mlx_lm', 'httpx', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(),
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- against a supervisor -----------------------------------------------------------


def test_models_lists_the_model(sup: SupervisorProcess) -> None:
    out = mlxd("models", "--url", sup.url)
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "CONTEXT", "TAKES", "SOURCE", "STATE"]
    [tiny] = [row.split() for row in rows if row.split()[0] == "tiny"]
    assert tiny[3:6] == ["4K", "-", "config"]  # its 4096-token window; no images, tools or reasoning
    listing = json.loads(mlxd("models", "--json", "--url", sup.url).stdout)
    [card] = [m for m in listing["data"] if m["id"] == "tiny"]
    assert card["context_window"] == 4096 and card["capabilities"] == ["completion"]


def test_load_ps_unload(sup: SupervisorProcess) -> None:
    loaded = mlxd("load", "tiny", "--url", sup.url)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith("tiny is ready (loaded in ")
    row = ps_rows(sup)["tiny"]
    assert row[1] == "ready"
    engines = json.loads(mlxd("ps", "--json", "--url", sup.url).stdout)
    [tiny] = [e for e in engines["data"] if e["model"] == "tiny"]
    assert tiny["state"] == "ready" and str(tiny["pid"]) in row
    unloaded = mlxd("unload", "tiny", "--url", sup.url)
    assert unloaded.returncode == 0, unloaded.stderr
    assert unloaded.stdout.startswith("tiny unloaded")
    assert "tiny" not in ps_rows(sup)
    again = json.loads(mlxd("unload", "tiny", "--json", "--url", sup.url).stdout)
    assert again["was_loaded"] is False and again["state"] == "stopped"


def test_a_pinned_model_unloads_only_with_force(sup: SupervisorProcess) -> None:
    try:
        pinned = json.loads(mlxd("load", "tiny", "--pin", "--json", "--url", sup.url).stdout)
        assert pinned["pinned"] is True and pinned["state"] == "ready"
        assert ps_rows(sup)["tiny"][-2:] == ["pinned", "-"]
        refused = mlxd("unload", "tiny", "--url", sup.url)
        assert refused.returncode == 1
        assert "--force" in refused.stderr and refused.stdout == ""
        assert ps_rows(sup)["tiny"][1] == "ready"
        assert mlxd("load", "tiny", "--url", sup.url).returncode == 0  # no --pin: left pinned
        assert ps_rows(sup)["tiny"][-2:] == ["pinned", "-"]
    finally:
        forced = mlxd("unload", "tiny", "--force", "--url", sup.url)
    assert forced.returncode == 0, forced.stderr
    assert "tiny" not in ps_rows(sup)


def test_no_pin_unpins(sup: SupervisorProcess) -> None:
    assert mlxd("load", "tiny", "--pin", "--url", sup.url).returncode == 0
    unpinned = json.loads(mlxd("load", "tiny", "--no-pin", "--json", "--url", sup.url).stdout)
    assert unpinned["pinned"] is False
    unloaded = mlxd("unload", "tiny", "--url", sup.url)
    assert unloaded.returncode == 0, unloaded.stderr


def test_an_unknown_model_is_the_servers_404(sup: SupervisorProcess) -> None:
    out = mlxd("load", "no-such-model", "--url", sup.url)
    assert out.returncode == 1
    assert out.stderr.startswith("Error: ") and "no-such-model" in out.stderr


def test_drain(sup: SupervisorProcess) -> None:
    assert mlxd("load", "tiny", "--url", sup.url).returncode == 0
    drained = mlxd("drain", "tiny", "--json", "--url", sup.url)
    assert drained.returncode == 0, drained.stderr
    assert [d["model"] for d in json.loads(drained.stdout)["drained"]] == ["tiny"]
    every = mlxd("drain", "--url", sup.url)
    assert every.returncode == 0, every.stderr
    assert every.stdout.split()[:5] == ["NAME", "FINISHED", "CANCELLED", "WAITED", "CACHE"] or \
        every.stdout.startswith("nothing to drain")


def test_lease_runs_the_command_with_its_id_and_releases_it(sup: SupervisorProcess) -> None:
    out = mlxd("lease", "tiny", "--url", sup.url, "--", sys.executable, "-c", PRINT_LEASE)
    assert out.returncode == 0, out.stderr
    word, lease_id, url = out.stdout.split()
    assert (word, url) == ("lease", sup.url)
    assert f"mlxd lease: {lease_id} held on tiny" in out.stderr
    record = wait_lease_ended(sup, lease_id)
    assert (record["state"], record["ended_reason"]) == ("ended", "released")
    assert record["holder"].startswith("mlxd lease: ")


def test_the_leased_commands_requests_pass_the_lease(sup: SupervisorProcess) -> None:
    out = mlxd("lease", "tiny", "--url", sup.url, "--", sys.executable, "-c", LEASED_REQUEST)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "status 200 2\n"


def test_lease_exits_with_the_commands_code(sup: SupervisorProcess) -> None:
    out = mlxd("lease", "--all", "--json", "--url", sup.url, "--", sys.executable, "-c", "raise SystemExit(3)")
    assert out.returncode == 3, out.stderr
    held = json.loads(out.stdout.splitlines()[0])
    assert held["state"] == "held" and held["model"] is None
    assert wait_lease_ended(sup, held["id"])["ended_reason"] == "released"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_mlxd_lease_reaches_the_command_and_releases_the_lease(
    sup: SupervisorProcess, sig: signal.Signals,
) -> None:
    with spawn_lease(sup.url, "tiny", "--holder", "signal test", "--", sys.executable, "-c", WAIT_FOR_SIGNAL) as proc:
        try:
            lease_id = read_ready(proc)
            assert lease_record(sup, lease_id)["state"] == "held"
            proc.send_signal(sig)
            assert proc.wait(30) == 128 + sig
        finally:
            kill_session(proc)
    record = wait_lease_ended(sup, lease_id)
    assert (record["state"], record["ended_reason"], record["holder"]) == ("ended", "released", "signal test")


def test_a_sigkilled_mlxd_lease_leaves_the_lease_to_expire(sup: SupervisorProcess) -> None:
    with spawn_lease(sup.url, "tiny", "--ttl", "2", "--", sys.executable, "-c", WAIT_FOR_SIGNAL) as proc:
        try:
            lease_id = read_ready(proc)
            first = lease_record(sup, lease_id)["expires_at"]
            assert wait_for(lambda: lease_record(sup, lease_id)["expires_at"] > first, 10, interval=0.1)  # renewed
            assert lease_record(sup, lease_id)["state"] == "held"
        finally:
            kill_session(proc)  # mlxd lease and its command: nothing releases the lease
    record = wait_lease_ended(sup, lease_id, timeout=20)
    assert (record["state"], record["ended_reason"]) == ("ended", "expired")


def test_an_admin_key_is_needed_when_keys_are_configured(tiny_model: Path, tmp_path: Path) -> None:
    config = f'[server]\nadmin_keys = ["{ADMIN_KEY}"]\n\n[models.tiny]\npath = "{tiny_model}"\n'
    keyed = SupervisorProcess(config, tmp_path / "data").wait_up()
    try:
        refused = mlxd("models", "--url", keyed.url)
        assert refused.returncode == 1 and "MLXD_ADMIN_KEY" in refused.stderr
        wrong = mlxd("ps", "--url", keyed.url, env=cli_env(MLXD_API_KEY="nope"))
        assert wrong.returncode == 1 and "refused the key in $MLXD_API_KEY" in wrong.stderr
        listed = mlxd("models", "--url", keyed.url, env=cli_env(MLXD_ADMIN_KEY=ADMIN_KEY, MLXD_API_KEY="nope"))
        assert listed.returncode == 0, listed.stderr
        assert "tiny" in listed.stdout
        ps = mlxd("ps", "--url", keyed.url, env=cli_env(MLXD_ADMIN_KEY=ADMIN_KEY))
        assert ps.returncode == 0, ps.stderr
    finally:
        keyed.stop()
