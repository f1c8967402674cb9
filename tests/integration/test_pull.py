"""`mlxd pull` against a stand-in hub (tests/hub_stub.py), and `mlxd rm`, as real processes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from tests.hub_stub import HubStub, running_hub
from tests.support import SupervisorProcess, default_sigint, free_port, wait_for

REPO = "test-org/tiny-llama"
NEEDED = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
# Files of other formats a real repo carries beside the MLX ones; `mlxd pull` must skip them.
OTHER_FORMATS = {"pytorch_model.bin": b"x" * 10, "model.gguf": b"g" * 10, "onnx/model.onnx": b"o" * 10,
                 "README.md": b"# tiny"}
BIG = "test-org/big"
LLAMA_CONFIG = json.dumps({"model_type": "llama"}).encode()


@pytest.fixture(scope="module")
def hub(tiny_model: Path) -> Iterator[HubStub]:
    with running_hub() as stub:
        files = {f.name: f.read_bytes() for f in tiny_model.iterdir() if f.is_file()}
        assert set(files) == NEEDED
        stub.add_repo(REPO, {**files, **OTHER_FORMATS})
        stub.add_repo("test-org/gated-llama", files, gated=True)
        stub.add_repo("test-org/no-config", {"README.md": b"hi", "model.safetensors": b"w" * 10})
        stub.add_repo("test-org/odd-arch", {"config.json": json.dumps({"model_type": "not-an-arch"}).encode(),
                                            "model.safetensors": b"w" * 1000})
        # Past huggingface_hub's 10 MiB read size: a cut file resumes at a chunk's end, never within one.
        stub.add_repo(BIG, {"config.json": LLAMA_CONFIG, "model.safetensors": bytes(range(256)) * (44 * 1024)})
        stub.add_repo("test-org/torch-only", {"config.json": LLAMA_CONFIG, "pytorch_model.bin": b"w" * 10})
        yield stub


@pytest.fixture
def env(hub: HubStub, tmp_path: Path) -> dict[str, str]:
    """The CLI's environment: the stub hub, a private hub cache and data dir, no daemon at its URL."""
    drop = {"HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS", "MLXD_URL",
            "MLXD_ADMIN_KEY", "MLXD_API_KEY", "MLXD_CONFIG", "MLXD_HOST", "MLXD_PORT"}
    return {
        **{k: v for k, v in os.environ.items() if k not in drop},
        "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_HUB_DISABLE_TELEMETRY": "1", "MLXD_DATA_DIR": str(tmp_path / "data"),
        "MLXD_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens: `rm` finds no daemon
    }


def mlxd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m mlxd ARGS` to completion, stdin not a terminal."""
    return subprocess.run([sys.executable, "-m", "mlxd", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=120, check=False)


def snapshot_files(env: dict[str, str], repo: str = REPO) -> set[str]:
    """The names under the repo's snapshots in the hub cache."""
    storage = Path(env["HF_HUB_CACHE"]) / ("models--" + repo.replace("/", "--"))
    return {p.relative_to(s).as_posix() for s in (storage / "snapshots").iterdir() for p in s.rglob("*")}


def blob(env: dict[str, str], data: bytes, repo: str = REPO, suffix: str = "") -> Path:
    """Where the hub cache keeps (or fetches, with `suffix` ".mlxd-partial") the file holding `data`."""
    storage = Path(env["HF_HUB_CACHE"]) / ("models--" + repo.replace("/", "--"))
    return storage / "blobs" / (hashlib.sha256(data).hexdigest() + suffix)


@pytest.fixture
def weights(tiny_model: Path) -> bytes:
    return (tiny_model / "model.safetensors").read_bytes()


def stop_pull_after(hub: HubStub, env: dict[str, str], num_bytes: int) -> subprocess.CompletedProcess[str]:
    """A pull of REPO whose weights' connection drops after `num_bytes`, the hub down after that."""
    hub.cut_after("model.safetensors", num_bytes, then_fail=True)
    try:
        return mlxd(env, "pull", REPO)
    finally:
        hub.heal()


def pulled(env: dict[str, str]) -> list[str]:
    return [p["repo"] for p in json.loads((Path(env["MLXD_DATA_DIR"]) / "pulled.json").read_text())["pulls"]]


def test_pull_fetches_only_what_mlx_needs_and_a_running_mlxd_serves_it(env: dict[str, str], tmp_path: Path) -> None:
    sup = SupervisorProcess("", tmp_path / "sup", env={"HF_HUB_CACHE": env["HF_HUB_CACHE"]}).wait_up()
    try:
        out = mlxd(env, "pull", REPO)
        assert out.returncode == 0, out.stderr
        assert out.stdout == f"{REPO}\n"
        assert f"run it: mlxd run {REPO}" in out.stderr
        assert snapshot_files(env) == NEEDED
        for name in NEEDED:  # not a terminal: a plain line per file
            assert f"  {name}: fetching" in out.stderr
        assert pulled(env) == [REPO]
        # The listing rescans the cache (a request naming the model does not yet: see docs/pull.md).
        assert REPO in [m["id"] for m in sup.client.get("/v1/models").json()["data"]]
        reply = sup.openai().chat.completions.create(model=REPO, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=3)
        assert reply.choices[0].message.content is not None
        refused = mlxd({**env, "MLXD_URL": sup.url}, "rm", "-y", REPO)
        assert refused.returncode == 1
        assert refused.stderr == f"Error: mlxd has {REPO} loaded; unload it first: mlxd unload {REPO}\n"
        assert snapshot_files(env) == NEEDED
        assert mlxd({**env, "MLXD_URL": sup.url}, "unload", REPO).returncode == 0
        removed = mlxd({**env, "MLXD_URL": sup.url}, "rm", "-y", REPO)
    finally:
        sup.stop()
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.startswith(f"removed {REPO} (") and removed.stdout.endswith(" KB freed\n")
    assert not (Path(env["HF_HUB_CACHE"]) / "models--test-org--tiny-llama").exists()
    assert pulled(env) == []


def test_a_dropped_connection_is_resumed_with_a_range_request(hub: HubStub, env: dict[str, str]) -> None:
    hub.cut_after("model.safetensors", 11_000_000)
    try:
        out = mlxd(env, "pull", BIG)
    finally:
        hub.heal()
    assert out.returncode == 0, out.stderr
    assert "  model.safetensors: resuming at 11 MB of 12 MB (" in out.stderr
    assert hub.ranges("model.safetensors") == ["bytes=11000000-"]  # every byte received is kept
    big = Path(env["HF_HUB_CACHE"]) / "models--test-org--big" / "snapshots"
    [weights] = big.glob("*/model.safetensors")
    assert weights.read_bytes() == bytes(range(256)) * (44 * 1024)


def test_a_pull_that_gives_up_resumes_where_it_stopped_when_run_again(hub: HubStub, env: dict[str, str],
                                                                     weights: bytes) -> None:
    out = stop_pull_after(hub, env, 100_000)
    assert out.returncode == 1
    last = out.stderr.splitlines()[-1]
    assert last.startswith(f"Error: download of {REPO} stopped at model.safetensors ("), out.stderr
    assert last.endswith("); run the same command again to resume (100 KB of 495 KB fetched)")
    assert snapshot_files(env) == NEEDED - {"model.safetensors"}
    assert blob(env, weights, suffix=".mlxd-partial").read_bytes() == weights[:100_000]
    hub.seen.clear()
    again = mlxd(env, "pull", REPO)
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"{REPO}\n"  # listed, under the id mlxd serves it as
    assert "  tokenizer.json: already here" in again.stderr
    assert "  model.safetensors: resuming at 100 KB of 495 KB\n" in again.stderr
    assert [s.path.rpartition("/")[2] for s in hub.seen if s.method == "GET"] == ["main", "model.safetensors"]
    assert hub.ranges("model.safetensors") == ["bytes=100000-"]
    assert hashlib.sha256(blob(env, weights).read_bytes()).digest() == hashlib.sha256(weights).digest()
    assert not blob(env, weights, suffix=".mlxd-partial").exists()
    assert snapshot_files(env) == NEEDED


def test_a_corrupt_partial_file_is_deleted_and_fetched_again(hub: HubStub, env: dict[str, str],
                                                             weights: bytes) -> None:
    assert stop_pull_after(hub, env, 100_000).returncode == 1
    partial = blob(env, weights, suffix=".mlxd-partial")
    with partial.open("r+b") as f:
        f.write(b"\0" * 100)
    corrupt = mlxd(env, "pull", REPO)
    assert corrupt.returncode == 1
    assert corrupt.stderr.splitlines()[-1] == (
        f"Error: model.safetensors came down corrupt (its sha256 is not {hashlib.sha256(weights).hexdigest()}, "
        "the one the hub gives); deleted it: run the same command again to fetch it from the start")
    assert not partial.exists() and not blob(env, weights).exists()
    hub.seen.clear()
    again = mlxd(env, "pull", REPO)
    assert again.returncode == 0, again.stderr
    assert hub.ranges("model.safetensors") == []
    assert blob(env, weights).read_bytes() == weights


def test_a_hub_that_ignores_range_gives_the_whole_file_again(hub: HubStub, env: dict[str, str],
                                                             weights: bytes) -> None:
    assert stop_pull_after(hub, env, 100_000).returncode == 1
    hub.ignores_range = True
    try:
        again = mlxd(env, "pull", REPO)
    finally:
        hub.heal()
    assert again.returncode == 0, again.stderr
    assert hub.ranges("model.safetensors")[-1] == "bytes=100000-"
    assert blob(env, weights).read_bytes() == weights
    assert snapshot_files(env) == NEEDED


def test_weights_on_a_cdn_come_without_the_token(hub: HubStub, env: dict[str, str], weights: bytes) -> None:
    hub.uses_cdn = True
    hub.seen.clear()
    try:
        out = mlxd({**env, "HF_TOKEN": "hf_secret"}, "pull", REPO)
    finally:
        hub.heal()
    assert out.returncode == 0, out.stderr
    cdn = [s for s in hub.seen if s.path.startswith("/cdn/")]
    assert [s.method for s in cdn] == ["GET"]  # the HEADs stop at the hub's redirect
    assert not cdn[0].has_auth
    assert all(s.has_auth for s in hub.seen if "/resolve/" in s.path)
    assert blob(env, weights).read_bytes() == weights


def test_two_pulls_of_one_repo_fetch_its_weights_once(hub: HubStub, env: dict[str, str], tmp_path: Path,
                                                      weights: bytes) -> None:
    hub.healed.clear()
    hub.stall_after("model.safetensors", 1000)
    first_err, second_err = (tmp_path / "first.err").open("w+"), (tmp_path / "second.err").open("w+")
    procs = []
    try:
        # A read timeout longer than the test: the first pull must not go on before the heal.
        procs.append(subprocess.Popen([sys.executable, "-m", "mlxd", "pull", REPO], stdout=subprocess.DEVNULL,
                                      stderr=first_err, stdin=subprocess.DEVNULL,
                                      env={**env, "HF_HUB_DOWNLOAD_TIMEOUT": "120"}))
        assert wait_for(hub.stalled.is_set, timeout=60)
        procs.append(subprocess.Popen([sys.executable, "-m", "mlxd", "pull", REPO], stdout=subprocess.DEVNULL,
                                      stderr=second_err, stdin=subprocess.DEVNULL, env=env))
        waiting = "warning: another mlxd pull is fetching model.safetensors; waiting for it\n"
        assert wait_for(lambda: waiting in (tmp_path / "second.err").read_text(), timeout=60)
        hub.heal()
        assert [p.wait(timeout=60) for p in procs] == [0, 0], (tmp_path / "first.err").read_text()
    finally:
        hub.heal()
        hub.stalled.clear()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        first_err.close()
        second_err.close()
    assert hub.ranges("model.safetensors") == ["bytes=1000-"]  # the first pull's, after the cut; the second fetched none
    assert blob(env, weights).read_bytes() == weights
    assert snapshot_files(env) == NEEDED


def test_ctrl_c_stops_a_pull_with_one_line(hub: HubStub, env: dict[str, str], weights: bytes) -> None:
    hub.healed.clear()
    hub.stall_after("model.safetensors", 1000)
    proc = subprocess.Popen([sys.executable, "-m", "mlxd", "pull", REPO], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
                            preexec_fn=default_sigint)
    try:
        partial = blob(env, weights, suffix=".mlxd-partial")
        assert wait_for(lambda: partial.exists() and partial.stat().st_size == 1000, timeout=60)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        hub.heal()
        hub.stalled.clear()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, out) == (130, "")
    assert err.endswith("\ninterrupted: run the same command again to resume (1.0 KB of 495 KB fetched)\n"), err
    assert partial.read_bytes() == weights[:1000]


def test_a_repo_without_config_json_is_refused(env: dict[str, str]) -> None:
    out = mlxd(env, "pull", "test-org/no-config")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == "Error: test-org/no-config is not an MLX/transformers model: no config.json\n"


def test_a_model_type_mlx_lm_lacks_is_refused_before_the_weights(hub: HubStub, env: dict[str, str]) -> None:
    hub.seen.clear()
    out = mlxd(env, "pull", "test-org/odd-arch@main")
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] + "\n" == ("Error: test-org/odd-arch cannot be served: model_type 'not-an-arch' is not supported "
                          "by the installed mlx-lm\n")
    assert not [s for s in hub.seen if s.path.endswith("model.safetensors")]
    assert not (Path(env["HF_HUB_CACHE"]) / "models--test-org--odd-arch").exists()


def test_a_repo_without_safetensors_is_pulled_with_a_warning(env: dict[str, str]) -> None:
    out = mlxd(env, "pull", "test-org/torch-only")
    assert out.returncode == 0, out.stderr
    assert "warning: test-org/torch-only has no model*.safetensors weights" in out.stderr
    assert "warning: mlxd does not list test-org/torch-only" in out.stderr
    assert out.stdout == ""
    assert snapshot_files(env, "test-org/torch-only") == {"config.json"}


@pytest.mark.parametrize(("spec", "message"), [
    ("test-org/missing", "test-org/missing not found on {url} (or it is private: set HF_TOKEN)"),
    (f"{REPO}@v9", f"{REPO} has no revision 'v9' on {{url}}"),
    ("test-org/gated-llama", "test-org/gated-llama is gated: accept its terms on {url}/test-org/gated-llama, "
                             "then set HF_TOKEN to a token of that account"),
    ("not a repo", "'not a repo' is not a Hugging Face repo id (ORG/NAME, e.g. mlx-community/Qwen3-0.6B-4bit)"),
    (f"{REPO}@", f"'{REPO}@': nothing after '@' (write REPO@REVISION, e.g. {REPO}@main)"),
])
def test_what_cannot_be_pulled_is_one_line_and_exit_1(hub: HubStub, env: dict[str, str], spec: str,
                                                      message: str) -> None:
    out = mlxd(env, "pull", spec)
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr.endswith(f"Error: {message.format(url=hub.url)}\n"), out.stderr


def test_a_hub_that_does_not_answer_is_one_line(env: dict[str, str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = mlxd({**env, "HF_ENDPOINT": url}, "pull", REPO)
    assert out.returncode == 1
    assert out.stderr.startswith(f"Error: cannot reach {url}: ")
    assert len(out.stderr.splitlines()) == 1


def test_offline_serves_from_the_cache_or_says_it_cannot(hub: HubStub, env: dict[str, str]) -> None:
    assert mlxd(env, "pull", REPO).returncode == 0
    hub.seen.clear()
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    out = mlxd(offline, "pull", REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{REPO}\n"
    assert f"{REPO}@main is already in the hub cache (HF_HUB_OFFLINE is set)" in out.stderr
    missing = mlxd(offline, "pull", "test-org/gated-llama")
    assert missing.returncode == 1
    assert missing.stderr == (f"Error: HF_HUB_OFFLINE is set and test-org/gated-llama@main is not in the hub cache "
                              f"({env['HF_HUB_CACHE']}); unset HF_HUB_OFFLINE to download it\n")
    assert hub.seen == []


def test_a_terminal_gets_a_progress_bar(env: dict[str, str]) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "mlxd", "pull", REPO], env=env, encoding="utf-8", timeout=60,
                          dimensions=(24, 120))
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    bars = [line for line in child.before.replace("\r", "\n").splitlines() if line.startswith("model.safetensors")]
    assert any("100%" in line and "495k/495k" in line for line in bars), child.before


# --- rm ------------------------------------------------------------------------------------


def test_rm_deletes_an_imported_model_and_names_what_exists_otherwise(tiny_model: Path, env: dict[str, str]) -> None:
    model = Path(env["MLXD_DATA_DIR"]) / "models" / "my-import"
    shutil.copytree(tiny_model, model)
    unknown = mlxd(env, "rm", "my-imprt")
    assert unknown.returncode == 1
    assert unknown.stderr == "Error: Model 'my-imprt' not found. Available: my-import\n"
    near = mlxd(env, "rm", "MY-IMPORT")
    assert near.returncode == 1
    assert near.stderr == "Error: no model 'MY-IMPORT'; did you mean 'my-import'? (`mlxd rm` takes the exact id)\n"
    out = mlxd(env, "rm", "my-import")  # stdin is not a terminal: nothing to confirm with
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"removed my-import ({model}): 509 KB freed\n"
    assert not model.exists()


def test_rm_asks_on_a_terminal(tiny_model: Path, env: dict[str, str]) -> None:
    model = Path(env["MLXD_DATA_DIR"]) / "models" / "keep-me"
    shutil.copytree(tiny_model, model)
    child = pexpect.spawn(sys.executable, ["-m", "mlxd", "rm", "keep-me"], env=env, encoding="utf-8", timeout=60)
    child.expect_exact(f"Remove keep-me (509 KB, {model})? [y/N]: ")
    child.sendline("n")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1
    assert model.is_dir()


def test_rm_leaves_a_hub_repo_that_mlxd_did_not_pull(tiny_model: Path, env: dict[str, str]) -> None:
    storage = Path(env["HF_HUB_CACHE"]) / "models--other-tool--model"
    shutil.copytree(tiny_model, storage / "snapshots" / ("a" * 40))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text("a" * 40)
    out = mlxd(env, "rm", "-y", "other-tool/model")
    assert out.returncode == 1
    assert out.stderr == (f"Error: other-tool/model is in the Hugging Face cache ({storage}) but `mlxd pull` did not "
                          "put it there, so mlxd leaves it alone; delete it with: hf cache rm model/other-tool/model\n")
    assert (storage / "snapshots" / ("a" * 40) / "model.safetensors").is_file()


def test_rm_imports_neither_huggingface_hub_nor_aiohttp_nor_mlx(env: dict[str, str]) -> None:
    script = (
        "import sys\nfrom mlxd.cli.main import main\n"
        "try:\n    main(['rm', '-y', 'nothing'])\nexcept SystemExit as exc:\n    assert exc.code == 1\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'mlx', 'mlx_lm', 'huggingface_hub')))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                         check=False)
    assert (out.returncode, out.stdout) == (0, "[]\n"), out.stderr


# --- Ollama's /api/pull and /api/delete: the same over HTTP ---


@pytest.fixture
def served(env: dict[str, str], tmp_path: Path) -> Iterator[SupervisorProcess]:
    """A supervisor whose hub is the stub, its hub cache and data dir the CLI's, with an admin key."""
    hf = {k: env[k] for k in ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_DISABLE_TELEMETRY")}
    config = '[server]\napi_keys = ["sk-user"]\nadmin_keys = ["sk-admin"]\n'
    sup = SupervisorProcess(config, Path(env["MLXD_DATA_DIR"]), env=hf).wait_up()
    yield sup
    sup.stop()


ADMIN = {"Authorization": "Bearer sk-admin"}


def test_ollama_pull_streams_progress_serves_the_model_and_delete_removes_it(served: SupervisorProcess,
                                                                               env: dict[str, str]) -> None:
    import ollama

    with ollama.Client(host=served.url, headers=ADMIN) as client:
        lines = list(client.pull(REPO, stream=True))
        assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
        files = {p.digest: p for p in lines if p.digest}
        assert set(files) == NEEDED  # only what mlx needs: the other formats are skipped
        for name, last in files.items():
            assert last.total and last.completed == last.total, name  # each file's last line: all of it
        assert snapshot_files(env) == NEEDED and pulled(env) == [REPO]
        assert REPO in [m.model for m in client.list().models]  # served at once
        answer = client.chat(model=REPO, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 3})
        assert answer.done and answer.eval_count == 3
        assert client.pull(REPO, stream=False).status == "success"  # again: all of it cached
        assert client.delete(REPO).status == "success"  # its engine drained and stopped first
        assert REPO not in [m.model for m in client.list().models]
    assert not (Path(env["HF_HUB_CACHE"]) / "models--test-org--tiny-llama").exists() and pulled(env) == []


def test_ollama_pull_and_delete_refuse_what_they_cannot_do(served: SupervisorProcess, tiny_model: Path,
                                                           env: dict[str, str]) -> None:
    import ollama

    with ollama.Client(host=served.url, headers={"Authorization": "Bearer sk-user"}) as user:
        with pytest.raises(ollama.ResponseError) as info:
            user.pull(REPO, stream=False)
        assert info.value.status_code == 401  # a user key may not change what is on disk
    storage = Path(env["HF_HUB_CACHE"]) / "models--other-tool--model"
    shutil.copytree(tiny_model, storage / "snapshots" / ("a" * 40))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text("a" * 40)
    with ollama.Client(host=served.url, headers=ADMIN) as client:
        with pytest.raises(ollama.ResponseError) as info:
            client.delete("other-tool/model")
        assert info.value.status_code == 409 and "did not put it there" in info.value.error
        assert (storage / "snapshots" / ("a" * 40) / "model.safetensors").is_file()
        with pytest.raises(ollama.ResponseError) as info:
            client.delete("test-org/nothing")
        assert info.value.status_code == 404
        with pytest.raises(ollama.ResponseError) as info:
            client.pull("not a repo id", stream=False)
        assert info.value.status_code == 400 and "repo id" in info.value.error
        with pytest.raises(ollama.ResponseError) as info:  # streamed: the error is the last line
            list(client.pull("test-org/no-config", stream=True))
        assert "no config.json" in info.value.error
