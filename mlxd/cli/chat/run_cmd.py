"""`mlxd run MODEL [PROMPT]`: chat with a model in the terminal, or answer one prompt for a script.

It talks to the daemon as any client does (`POST /v1/chat/completions`, streamed), on the
stdlib's http.client so it starts fast; it starts the daemon first when none runs, as
`mlxd start` would. docs/run.md describes it.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import click
from rich.console import Console

from mlxd.cli.admin.client import AdminClient, AdminError, HTTPFailure, Unreachable
from mlxd.cli.admin.cmds import daemon_options, daemon_url, resolve_url
from mlxd.cli.chat.commands import Settings
from mlxd.cli.chat.images import ImageError
from mlxd.cli.chat.session import AnswerView, Conversation, Target, stream_answer
from mlxd.cli.chat.stream import ChatStream
from mlxd.cli.chat.wait import find_model

KEY_VARS = ("MLXD_API_KEY", "MLXD_ADMIN_KEY")  # an inference key first: that is what run uses
EXIT_INTERRUPTED = 128 + signal.SIGINT


def chat_key(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The key to send and the variable it came from: $MLXD_API_KEY, else $MLXD_ADMIN_KEY."""
    for name in KEY_VARS:
        if value := env.get(name, "").strip():
            return value, name
    return None, None


def describe_error(exc: AdminError, url: str, key_source: str | None) -> str:
    """The one line for a failed request: the server's words, plus what to do about a 401."""
    if not (isinstance(exc, HTTPFailure) and exc.status == 401):
        return str(exc)
    if key_source:
        return f"mlxd at {url} refused the key in ${key_source} (server said: {exc.message})"
    return f"mlxd at {url} needs a key: set MLXD_API_KEY (server said: {exc.message})"


# --- finding (or starting) the daemon ---------------------------------------------------


def find_daemon(url: str | None, config: Path | None, data_dir: Path | None, no_start: bool,
                err: Console) -> str:
    """The daemon's URL; start it first when none answers, unless told where it is or --no-start."""
    from mlxd.cli.service.managers import current_system

    system = current_system()
    is_explicit = bool(url or system.env.get("MLXD_URL", "").strip())
    base = resolve_url(url, config, data_dir, system)
    try:
        AdminClient(base).get("/health", timeout=10.0)
        return base
    except Unreachable as exc:
        if is_explicit or no_start:
            raise click.ClickException(str(exc)) from None
    except AdminError as exc:
        raise click.ClickException(str(exc)) from None
    return start_daemon(config, data_dir, err)


def start_daemon(config: Path | None, data_dir: Path | None, err: Console) -> str:
    """Start mlxd as `mlxd start` does, with a spinner on stderr; its URL once /health answers."""
    from mlxd.cli.service import cmds as service_cmds
    from mlxd.cli.service.managers import current_system
    from mlxd.cli.service.spec import ServeOptions

    system = current_system()
    if not err.is_terminal:
        err.print("starting mlxd…", highlight=False)
    with err.status("starting mlxd…"):
        said = service_cmds.start_daemon(system, ServeOptions(config=config, data_dir=data_dir))
    err.print(said, style="dim", highlight=False, markup=False)
    return daemon_url(config, data_dir, system)


def check_model(target: Target) -> str:
    """The model's id as the daemon lists it; the daemon's own 404 (which lists what exists) if none."""
    listing = target.client().get("/v1/models")
    if (entry := find_model(listing, target.model)) is not None:
        return str(entry["id"])
    # Not listed: an empty conversation gets the daemon's 404 for an unknown model, without generating.
    stream = ChatStream(target.url, target.key)
    try:
        stream.open({"model": target.model, "messages": [], "stream": True})
    except HTTPFailure as exc:
        if exc.status == 404:
            raise
    finally:
        stream.close()
    return target.model


# --- the two modes ----------------------------------------------------------------------


def one_shot(target: Target, conversation: Conversation, prompt: str, think: bool, verbose: bool) -> int:
    """Print the answer to `prompt` on stdout, the stats (--verbose) on stderr; the exit code."""
    out = Console(highlight=False, soft_wrap=True, emoji=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    show_wait = out.is_terminal and err.is_terminal
    view = AnswerView(out, show_reasoning=think, stats=err if verbose else None, wait=err if show_wait else None)
    try:
        answer, interrupted = stream_answer(target, conversation, prompt, view)
    except AdminError as exc:
        view.end_line()
        raise click.ClickException(describe_error(exc, target.url, target.key_source)) from None
    except ImageError as exc:
        raise click.ClickException(str(exc)) from None
    view.finish(answer, interrupted)
    if interrupted:
        click.echo("mlxd run: interrupted", err=True)
        return EXIT_INTERRUPTED
    return 0


def interactive(target: Target, conversation: Conversation) -> int:
    """The `>>> ` prompt until /bye or Ctrl-D, once the model is known to exist."""
    from mlxd.cli.chat.repl import Repl  # prompt_toolkit only here: one-shot runs start faster

    try:
        target.model = check_model(target)
    except AdminError as exc:
        raise click.ClickException(describe_error(exc, target.url, target.key_source)) from None
    return Repl(target, conversation, Console(highlight=False, soft_wrap=True, emoji=False)).run()


def read_prompt(words: tuple[str, ...]) -> str | None:
    """PROMPT, then piped stdin after it; None for the interactive mode (a terminal and no PROMPT)."""
    if sys.stdin is None or sys.stdin.isatty():
        return compose_prompt(words, None)
    try:
        return compose_prompt(words, sys.stdin.read())
    except UnicodeDecodeError as exc:
        raise click.UsageError(f"stdin is not text: {exc.reason}") from None


def compose_prompt(words: tuple[str, ...], piped: str | None) -> str | None:
    """The one-shot question: PROMPT's words, then the piped text after a blank line, as ollama does;
    None when there is neither and stdin is a terminal."""
    prompt = " ".join(words).strip()
    if piped is None:
        return prompt or None
    text = "\n\n".join(part for part in (prompt, piped.strip()) if part)
    if not text:
        raise click.UsageError("nothing to ask: give a PROMPT, or pipe text on stdin")
    return text


def params_from(temperature: float | None, top_p: float | None, max_tokens: int | None,
                seed: int | None) -> dict[str, float | int]:
    """The sampling parameters given on the command line."""
    given = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed}
    return {k: v for k, v in given.items() if v is not None}


@click.command("run")
@click.argument("model")
@click.argument("prompt", nargs=-1)
@click.option("--system", help="the system message")
@click.option("--temperature", type=click.FloatRange(0.0, 2.0), help="sampling temperature (0: greedy)")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), help="nucleus sampling")
@click.option("--max-tokens", type=click.IntRange(min=1), help="the most tokens an answer may have")
@click.option("--seed", type=int, help="same seed, same prompt, same settings: same answer")
@click.option("--think", is_flag=True, help="one-shot: print the model's reasoning too (interactive shows it dimmed)")
@click.option("--verbose", is_flag=True, help="one-shot: print tokens, tokens/s and time to first token on stderr")
@click.option("--no-start", is_flag=True, help="do not start mlxd when it is not running")
@daemon_options
def run(model: str, prompt: tuple[str, ...], system: str | None, temperature: float | None, top_p: float | None,
        max_tokens: int | None, seed: int | None, think: bool, verbose: bool, no_start: bool, url: str | None,
        config_file: Path | None, data_dir: Path | None) -> None:
    """Chat with MODEL, or answer PROMPT (and/or piped stdin) and exit.

    Starts mlxd when it is not running (unless --no-start, --url or $MLXD_URL).
    """
    ctx = click.get_current_context()
    conversation = Conversation(Settings(system, params_from(temperature, top_p, max_tokens, seed)))
    try:
        question = read_prompt(prompt)
        target = connect(model, url, config_file, data_dir, no_start)
        if question is not None:
            ctx.exit(one_shot(target, conversation, question, think, verbose))
        ctx.exit(interactive(target, conversation))
    except KeyboardInterrupt:
        click.echo("\nmlxd run: interrupted", err=True)
        ctx.exit(EXIT_INTERRUPTED)


def connect(model: str, url: str | None, config: Path | None, data_dir: Path | None, no_start: bool) -> Target:
    """The daemon (started if need be) and the key to use for `model`."""
    from mlxd.cli.service.managers import current_system

    base = find_daemon(url, config, data_dir, no_start, Console(stderr=True, highlight=False, soft_wrap=True))
    return Target(base, *chat_key(current_system().env), model)
