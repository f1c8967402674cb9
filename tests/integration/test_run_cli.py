"""`mlxd run` in a pseudo-terminal (pexpect) and in pipes, against a real supervisor and engines."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pexpect
import pytest

from tests.support import (
    SupervisorProcess,
    cli_env,
    default_sigint,
    free_port,
    mlxd,
    private_socket_dir,
    wait_for,
)

STATS = re.compile(r"~?(\d+) tokens? · (?:[\d.]+ tokens/s · )?first token [\d.]+ m?s( · stopped)?")
CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")
PROMPT = ">>>"  # its space is drawn as a cursor move once the placeholder is gone
SPINNER_FRAME = re.compile(r"[⠀-⣿] [^⠀-⣿\n]*?· (?:[\d.]+ m?s|\d+ m \d+ s)\n?")


@pytest.fixture(scope="module")
def sup(tiny_model: Path, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    config = (f'[models.tiny]\npath = "{tiny_model}"\n\n[models.cold]\npath = "{tiny_model}"\n\n'
              f'[models.smol]\npath = "{smollm2}"\n')
    proc = SupervisorProcess(config, tmp_path_factory.mktemp("run")).wait_up()
    yield proc
    proc.stop()


def plain(text: str) -> str:
    """Pty output without escape sequences and carriage returns."""
    return CSI.sub("", text).replace("\r", "")


def answer_part(text: str, question: str) -> str:
    """What came after the (last) echo of `question`, spinner frames removed."""
    return SPINNER_FRAME.sub("", text.rsplit(question, 1)[-1]) if question in text else ""


def has_prompt_after_stats(text: str) -> bool:
    """Whether an answer's stats line and then the next prompt are in `text`."""
    stats = list(STATS.finditer(text))
    return bool(stats) and PROMPT in text[stats[-1].end() :]


class Chat:
    """`mlxd run` at its `>>> ` prompt in a pseudo-terminal."""

    def __init__(self, sup: SupervisorProcess, model: str, *args: str) -> None:
        argv = ["-m", "mlxd", "run", "--url", sup.url, model, *args]
        # pexpect answers no cursor position request: without this, each prompt waits for one.
        env = cli_env(PROMPT_TOOLKIT_NO_CPR="1")
        self.child = pexpect.spawn(sys.executable, argv, env=env, encoding="utf-8", timeout=60, dimensions=(50, 200),
                                   preexec_fn=default_sigint)
        self.child.expect_exact(PROMPT)

    def command(self, line: str, reply: str) -> None:
        """Type a slash command and wait for its reply and the next prompt."""
        self.child.sendline(line)
        self.child.expect_exact(reply)
        self.child.expect_exact(PROMPT)

    def ask(self, question: str) -> tuple[str, re.Match[str]]:
        """The answer's text as shown, and its stats line."""
        self.child.sendline(question)
        self.child.expect(STATS)
        answer = answer_part(plain(self.child.before), question)
        match = self.child.match
        self.child.expect_exact(PROMPT)
        return answer.strip(), match

    def read_until(self, is_done: Callable[[str], bool], timeout: float = 60) -> str:
        """Read what comes until `is_done` holds for its text (escape sequences removed)."""
        return read_until(self.child, is_done, timeout)

    def bye(self) -> int:
        self.child.sendline("/bye")
        self.child.expect(pexpect.EOF)
        self.child.close()
        return int(self.child.exitstatus)


# --- interactive --------------------------------------------------------------------


def test_an_answer_streams_then_the_stats_line_and_bye_exits_0(sup: SupervisorProcess) -> None:
    chat = Chat(sup, "tiny", "--max-tokens", "12")
    answer, stats = chat.ask("hello there")
    assert answer
    assert 1 <= int(stats.group(1)) <= 12
    assert stats.group(2) is None
    assert chat.bye() == 0


def test_greedy_answers_repeat_after_clear(sup: SupervisorProcess) -> None:
    chat = Chat(sup, "tiny")
    chat.command("/set parameter temperature 0", "Set parameter 'temperature' to '0.0'.")
    chat.command("/set parameter max_tokens 16", "Set parameter 'max_tokens' to '16'.")
    chat.command("/set parameter top_k 3", "Unknown parameter 'top_k': use one of temperature, top_p, max_tokens, seed")
    first, _ = chat.ask("tell me something")
    chat.command("/clear", "Cleared the conversation.")
    chat.command("/show", "conversation: 0 turns")
    second, _ = chat.ask("tell me something")
    assert first and first == second
    chat.child.sendeof()  # Ctrl-D leaves like /bye
    chat.child.expect(pexpect.EOF)
    chat.child.close()
    assert chat.child.exitstatus == 0


@pytest.mark.slow  # SmolLM2 loads, then writes real text: about 10 s on a CPU
def test_ctrl_c_stops_an_answer_and_the_next_question_works(sup: SupervisorProcess) -> None:
    # Greedy: SmolLM2's story runs to the 3000 tokens (sampled, it may end before the Ctrl-C comes).
    chat = Chat(sup, "smol", "--max-tokens", "3000", "--temperature", "0")
    cancelled = num_cancelled(sup, "smol")
    chat.child.sendline("Write a very long story about a dragon who learns to bake bread.")
    chat.read_until(lambda seen: len(answer_part(seen, "bread.").split()) >= 3 and is_generating(sup, "smol"))
    chat.child.sendintr()
    chat.child.expect(STATS)
    assert chat.child.match.group(2) == " · stopped"
    chat.child.expect_exact(PROMPT)
    assert wait_cancelled(sup, "smol", cancelled), "the engine did not cancel the stopped answer"
    chat.command("/show", "conversation: 1 turn")  # what was printed stays in the conversation
    chat.command("/set parameter max_tokens 5", "Set parameter")
    answer, stats = chat.ask("And then?")
    assert answer and stats.group(2) is None
    chat.child.sendintr()  # at an empty prompt
    chat.child.expect_exact("Use Ctrl + d or /bye to exit.")
    assert chat.bye() == 0


def read_until(child: pexpect.spawn, is_done: Callable[[str], bool], timeout: float) -> str:
    """Read what `child` writes until `is_done` holds for its text (escape sequences removed)."""
    seen = [""]

    def read_more() -> bool:
        with contextlib.suppress(pexpect.TIMEOUT):
            seen[0] += child.read_nonblocking(4096, timeout=1)  # the poll's pause: up to 1 s
        return is_done(plain(seen[0]))

    wait_for(read_more, timeout, interval=0, message=lambda: f"timed out; saw {plain(seen[0])!r}")
    return plain(seen[0])


def model_state(sup: SupervisorProcess, model: str) -> str:
    """The model's state in the supervisor's /v1/models."""
    return str(next(m["state"] for m in sup.client.get("/v1/models").json()["data"] if m["id"] == model))


def num_cancelled(sup: SupervisorProcess, model: str) -> int:
    """Requests the model's engine has cancelled; 0 while it does not run (asking a socket nobody
    listens on would leak one: see tests.support.is_listening)."""
    return int(sup.engine_stats(model)["requests"]["cancelled"]) if model_state(sup, model) == "ready" else 0


def is_generating(sup: SupervisorProcess, model: str) -> bool:
    """Whether the model's engine is up and running a request (not still loading for it)."""
    return model_state(sup, model) == "ready" and int(sup.engine_stats(model)["requests"]["active"]) >= 1


def wait_cancelled(sup: SupervisorProcess, model: str, before: int, timeout: float = 20) -> bool:
    """Whether the model's engine, within `timeout`, runs nothing and has cancelled one more request."""
    def is_cancelled() -> bool:
        requests = sup.engine_stats(model)["requests"]
        return bool(requests["active"] == 0 and requests["cancelled"] > before)

    return wait_for(is_cancelled, timeout, interval=0.1)


def test_a_cold_model_shows_a_spinner_while_it_starts(sup: SupervisorProcess) -> None:
    chat = Chat(sup, "cold", "--max-tokens", "4")
    chat.child.sendline("hi")
    seen = chat.read_until(has_prompt_after_stats, timeout=120)
    assert re.search(r"loading cold: (starting the engine|reading weights|loading the tokenizer|warming up GPU kernels)", seen), seen
    assert chat.bye() == 0


def test_an_unknown_model_gets_the_servers_404_before_the_prompt(sup: SupervisorProcess) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "mlxd", "run", "--url", sup.url, "nope"], env=cli_env(),
                          encoding="utf-8", timeout=60)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1
    assert "Error: Model 'nope' not found. Available: " in child.before
    assert "tiny" in child.before


# --- one-shot -------------------------------------------------------------------------


def test_piped_stdin_answers_once_on_a_clean_stdout(sup: SupervisorProcess) -> None:
    argv = [sys.executable, "-m", "mlxd", "run", "--url", sup.url, "tiny", "--max-tokens", "6", "--temperature", "0"]
    out = subprocess.run(argv, input="hello\n", capture_output=True, text=True, env=cli_env(), timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and out.stdout.endswith("\n")
    assert out.stderr == ""
    verbose = subprocess.run([*argv, "--verbose"], input="hello\n", capture_output=True, text=True, env=cli_env(),
                             timeout=60, check=False)
    assert verbose.stdout == out.stdout  # greedy: the same answer, and the stats went to stderr
    assert STATS.fullmatch(verbose.stderr.strip()), verbose.stderr


def test_the_default_model_at_its_defaults_names_the_capital_of_france(sup: SupervisorProcess) -> None:
    """No sampling given anywhere: the default model's recommended sampling (written by
    `mlxd import-default`: greedy) over mlxd's defaults. At OpenAI's temperature 1 over the
    whole vocabulary it answered "Le Grand Citel de France ..." two times in three; at the
    model card's 0.2, "L'Étoile, la Marseillaise, ..." 23 times in 60 (importer.py)."""
    question = "What is the capital of France?"
    def ask(_: int) -> subprocess.CompletedProcess[str]:
        # Sampling left to the defaults, no seed (as a user asks); the length bounded.
        return mlxd("run", "--url", sup.url, "smol", question, "--max-tokens", "64")

    with ThreadPoolExecutor(2) as pool:  # two at a time
        runs = list(pool.map(ask, range(10)))
    assert [r.returncode for r in runs] == [0] * 10, [r.stderr for r in runs]
    right = [r.stdout for r in runs if "Paris" in r.stdout]
    assert len(right) >= 9, [r.stdout for r in runs]


def test_ctrl_c_stops_a_one_shot_answer_with_130(sup: SupervisorProcess) -> None:
    question = "Write a very long story about a cat who learns to sail."
    cancelled = num_cancelled(sup, "smol")
    child = pexpect.spawn(sys.executable, ["-m", "mlxd", "run", "--url", sup.url, "smol", question, "--max-tokens",
                                           "3000", "--temperature", "0"],  # greedy: it runs to 3000 tokens
                          env=cli_env(), encoding="utf-8", timeout=60, dimensions=(50, 200), preexec_fn=default_sigint)
    # The answer is streaming: words on screen (the load spinner's, on a slow machine) are not enough.
    def streams(seen: str) -> bool:
        return len(SPINNER_FRAME.sub("", seen).split()) >= 3 and is_generating(sup, "smol")

    read_until(child, streams, 120)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    assert plain(child.before).endswith("mlxd run: interrupted\n")
    assert wait_cancelled(sup, "smol", cancelled), "the engine did not cancel the stopped answer"


def test_one_shot_errors_are_one_line_and_exit_1(sup: SupervisorProcess, tmp_path: Path) -> None:
    unknown = mlxd("run", "--url", sup.url, "nope", "hi")
    assert (unknown.returncode, unknown.stdout) == (1, "")
    assert unknown.stderr.startswith("Error: Model 'nope' not found. Available: ")
    bad = mlxd("run", "--url", sup.url, "tiny", "hi", "--temperature", "9")
    assert bad.returncode == 2 and "--temperature" in bad.stderr
    empty = subprocess.run([sys.executable, "-m", "mlxd", "run", "--url", sup.url, "tiny"], input="",
                           capture_output=True, text=True, env=cli_env(), timeout=60, check=False)
    assert empty.returncode == 2 and "nothing to ask" in empty.stderr


def test_no_start_with_no_daemon_says_so(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "c.toml"
    config.write_text(f"[server]\nport = {port}\n")
    out = mlxd("run", "--no-start", "--config", str(config), "--data-dir", str(tmp_path / "d"), "tiny", "hi")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == f"Error: mlxd is not running at http://127.0.0.1:{port} (start it with `mlxd start`)\n"
    url = f"http://127.0.0.1:{free_port()}"
    out = mlxd("run", "tiny", "hi", env=cli_env(MLXD_URL=url))  # an address given: never started
    assert out.returncode == 1
    assert out.stderr == f"Error: mlxd is not running at {url} (start it with `mlxd start`)\n"


@pytest.mark.slow
def test_run_starts_the_daemon_when_none_runs(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "c.toml"
    config.write_text(f'[server]\nport = {port}\n\n[models.tiny]\npath = "{tiny_model}"\n')
    data = tmp_path / "data"
    env = cli_env(MLXD_RUNTIME_DIR=str(private_socket_dir()), MLXD_SPARE_ENGINE="0")
    try:
        out = mlxd("run", "--config", str(config), "--data-dir", str(data), "tiny", "hi", "--max-tokens", "3", env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip()
        assert out.stderr.startswith("starting mlxd…\n")
        assert f"mlxd is running at http://127.0.0.1:{port}" in out.stderr
    finally:
        stopped = mlxd("stop", "--data-dir", str(data), env=env)
        assert stopped.returncode == 0, stopped.stderr
