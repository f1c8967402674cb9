"""`mlxd run`'s pure parts: slash commands, triple-quoted blocks, SSE lines, answers, the wait text."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import click
import pytest
from rich.console import Console

from mlxd.cli.admin.client import HTTPFailure
from mlxd.cli.chat import images
from mlxd.cli.chat.answer import Answer, format_duration
from mlxd.cli.chat.commands import (
    Command,
    CommandError,
    Settings,
    closed_block,
    is_command,
    opens_block,
    parse_command,
)
from mlxd.cli.chat.run_cmd import chat_key, compose_prompt, describe_error, params_from
from mlxd.cli.chat.session import CONTROLS, AnswerView, Conversation
from mlxd.cli.chat.stream import DONE, Chunk, StreamFailure, chat_body, parse_sse_line
from mlxd.cli.chat.wait import LoadStatus, find_model, load_status, wait_text

# --- slash commands ---------------------------------------------------------------


@pytest.mark.parametrize(("line", "command"), [
    ("/bye", Command("bye")),
    ("  /BYE ", Command("bye")),
    ("/clear", Command("clear")),
    ("/show", Command("show")),
    ("/?", Command("help")),
    ("/help", Command("help")),
    ("/set parameter temperature 0.2", Command("parameter", "temperature", 0.2)),
    ("/set parameter TOP_P 1", Command("parameter", "top_p", 1.0)),
    ("/set parameter max_tokens 64", Command("parameter", "max_tokens", 64)),
    ("/set parameter seed -3", Command("parameter", "seed", -3)),
    ("/set system Be brief.", Command("system", value="Be brief.")),
    ('/set system "Answer in French."', Command("system", value="Answer in French.")),
    ('/set system """Two\nlines"""', Command("system", value="Two\nlines")),
])
def test_commands_parse(line: str, command: Command) -> None:
    assert is_command(line)
    assert parse_command(line) == command


@pytest.mark.parametrize(("line", "says"), [
    ("/nope", "Unknown command '/nope'. Type /? for help"),
    ("/bye now", "/bye takes no arguments"),
    ("/set", "Usage: /set system TEXT, or /set parameter NAME VALUE"),
    ("/set colour red", "Usage: /set system TEXT, or /set parameter NAME VALUE"),
    ("/set system", "Usage: /set system TEXT"),
    ("/set system  \"\" ", "Usage: /set system TEXT"),
    ("/set parameter", "Usage: /set parameter NAME VALUE (NAME is one of temperature, top_p, max_tokens, seed)"),
    ("/set parameter temperature", "Usage: /set parameter NAME VALUE"),
    ("/set parameter top_k 4", "Unknown parameter 'top_k': use one of temperature, top_p, max_tokens, seed"),
    ("/set parameter temperature hot", "temperature: 'hot' is not a number"),
    ("/set parameter temperature 3", "temperature: must be between 0 and 2, not 3"),
    ("/set parameter temperature nan", "temperature: must be between 0 and 2"),
    ("/set parameter max_tokens 0", "max_tokens: must be between 1 and"),
    ("/set parameter max_tokens 1.5", "max_tokens: '1.5' is not an integer"),
    ("/set parameter seed 99999999999999999999", "seed: must be between"),
])
def test_bad_commands_say_what_to_type(line: str, says: str) -> None:
    with pytest.raises(CommandError) as caught:
        parse_command(line)
    assert str(caught.value).startswith(says)


def test_messages_are_not_commands() -> None:
    assert not is_command("what is /etc/hosts?")
    assert not is_command('"""')


# --- triple-quoted blocks ---------------------------------------------------------


@pytest.mark.parametrize(("lines", "message"), [
    (['"""'], None),
    (['"""first', "second"], None),
    (['"""first', 'second"""'], "first\nsecond"),
    (['"""', "a", "", "b", '"""'], "a\n\nb"),
    (['"""one line"""'], "one line"),
    (['  """indented', '   end"""  '], "indented\n   end"),
    (['"""', '"""'], ""),
])
def test_a_block_closes_at_its_quotes(lines: list[str], message: str | None) -> None:
    assert opens_block(lines[0])
    assert closed_block(lines) == message


def test_a_plain_line_opens_no_block() -> None:
    assert not opens_block('say """hi"""')


# --- SSE lines and chunks --------------------------------------------------------


def test_sse_lines() -> None:
    assert parse_sse_line(b": keep-alive\n") is None
    assert parse_sse_line(b"\n") is None
    assert parse_sse_line(b"event: x\n") is None
    assert parse_sse_line(b"data: [DONE]\n") == DONE
    chunk = parse_sse_line(b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}, "x": 1}], "id": "c"}\r\n')
    assert isinstance(chunk, Chunk)
    assert chunk.choices[0].delta.content == "Hi"
    chunk = parse_sse_line(b'data:{"error": {"message": "engine crashed", "type": "server_error"}}')
    assert isinstance(chunk, Chunk) and chunk.error is not None and chunk.error.message == "engine crashed"


def test_an_event_that_is_not_a_chunk_is_a_failure() -> None:
    with pytest.raises(StreamFailure, match="not a chat chunk"):
        parse_sse_line(b"data: {not json\n")
    with pytest.raises(StreamFailure):
        parse_sse_line(b'data: {"choices": "many"}\n')


def test_the_body_streams_with_usage_and_only_set_parameters() -> None:
    body = chat_body("m", [{"role": "user", "content": "hi"}], {"temperature": 0.0, "seed": None})
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0.0}


def chunk(line: str) -> Chunk:
    parsed = parse_sse_line(b"data: " + line.encode())
    assert isinstance(parsed, Chunk)
    return parsed


def test_an_answer_collects_text_reasoning_calls_and_stats() -> None:
    answer = Answer(started=10.0)
    assert answer.feed(chunk('{"choices": [{"delta": {"role": "assistant", "content": ""}}]}'), 10.1) == []
    assert answer.first_at is None  # the empty role delta is no token
    [piece] = answer.feed(chunk('{"choices": [{"delta": {"reasoning_content": "hmm"}}]}'), 10.5)
    assert (piece.kind, piece.text, answer.first_at) == ("reasoning", "hmm", 10.5)
    answer.feed(chunk('{"choices": [{"delta": {"content": "Hel"}}]}'), 10.7)
    answer.feed(chunk('{"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",'
                      ' "function": {"name": "get", "arguments": ""}}]}}]}'), 10.8)
    answer.feed(chunk('{"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '
                      '"{\\"a\\": 1}"}}]}}]}'), 10.9)
    answer.feed(chunk('{"choices": [{"delta": {"content": "lo"}, "finish_reason": "tool_calls"}]}'), 12.5)
    answer.feed(chunk('{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}'),
                12.6)
    assert answer.text == "Hello"
    assert answer.finish_reason == "tool_calls"
    assert answer.tool_calls[0].line() == 'tool call: get({"a":1})'
    assert answer.stats() == "9 tokens · 4.0 tokens/s · first token 500 ms"


def test_stats_of_a_short_or_cut_answer() -> None:
    answer = Answer(started=0.0)
    answer.feed(chunk('{"choices": [{"delta": {"content": "x"}}]}'), 2.5)
    assert answer.stats() == "~1 token · first token 2.5 s"  # cut before the usage chunk
    answer.feed(chunk('{"choices": [{"delta": {"content": "y"}}]}'), 3.0)
    assert answer.stats() == "~2 tokens · 2.0 tokens/s · first token 2.5 s"
    answer.feed(chunk('{"choices": [], "usage": {"completion_tokens": 1}}'), 2.6)
    assert answer.stats() == "1 token · first token 2.5 s"


def test_durations() -> None:
    assert [format_duration(s) for s in (0.0123, 0.9994, 3.45, 125.0)] == ["12 ms", "999 ms", "3.5 s", "2 m 05 s"]


# --- conversation, settings, keys ------------------------------------------------


def test_the_conversation_sends_system_and_turns_and_keeps_only_answered_ones() -> None:
    convo = Conversation(Settings(system="Be brief."))
    answered = Answer(started=0.0, content=["Hi."])
    convo.remember(convo.user_turn("hello"), answered)
    convo.remember(convo.user_turn("again"), Answer(started=0.0))  # stopped before any text: forgotten
    assert convo.messages(convo.user_turn("next")) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "next"}]
    assert convo.num_turns == 1
    convo.clear()
    assert convo.messages(convo.user_turn("x")) == [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "x"}]


def test_image_paths_in_a_message_and_slash_image_go_as_image_parts(tmp_path: Path) -> None:
    photo, shot = tmp_path / "photo.PNG", tmp_path / "my shot.jpg"
    photo.write_bytes(b"\x89PNG fake")
    shot.write_bytes(b"jpeg bytes")
    text, found = images.split_images(f"what is in {photo} and {str(shot).replace(' ', chr(92) + ' ')}?")
    assert text == "what is in and ?" and found == [photo, shot]
    assert images.split_images(f"compare '{shot}' please") == ("compare please", [shot])
    # Not image files, or no such file: the words stay as they were.
    assert images.split_images("see /no/such.png and notes.txt") == ("see /no/such.png and notes.txt", [])
    convo = Conversation()
    convo.pending.append(images.image_path(f'"{shot}"'))  # /image, quoted
    turn = convo.user_turn(f"{photo} describe")
    assert turn["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(b"jpeg bytes").decode()}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()}},
        {"type": "text", "text": "describe"}]
    convo.remember(turn, Answer(started=0.0, content=["A cat."]))
    assert convo.pending == [] and convo.turns[0] == turn  # the images stay in the conversation
    with pytest.raises(images.ImageError, match="no such file"):
        images.image_path(str(tmp_path / "gone.png"))
    with pytest.raises(images.ImageError, match="not an image file"):
        images.image_path(str(tmp_path))
    assert parse_command("/image ~/a b.png") == Command("image", value="~/a b.png")
    with pytest.raises(CommandError, match="Usage: /image PATH"):
        parse_command("/image")


def test_show_lists_the_settings() -> None:
    settings = Settings(params={"temperature": 0.0, "seed": 3})
    assert settings.describe("tiny", 1) == ("model: tiny\nsystem: (none)\nparameters: seed 3, temperature 0.0\n"
                                            "conversation: 1 turn")


def test_the_inference_key_comes_first() -> None:
    assert chat_key({"MLXD_ADMIN_KEY": "a", "MLXD_API_KEY": "k"}) == ("k", "MLXD_API_KEY")
    assert chat_key({"MLXD_ADMIN_KEY": "a", "MLXD_API_KEY": " "}) == ("a", "MLXD_ADMIN_KEY")
    assert chat_key({}) == (None, None)
    assert params_from(0.0, None, 8, None) == {"temperature": 0.0, "max_tokens": 8}


# --- the wait for the first token -------------------------------------------------

LISTING = {"data": [
    {"id": "org/Qwen3-4B", "state": "starting", "loaded": False,
     "load": {"phase": "weights", "done": 1_200_000_000, "total": 2_400_000_000, "unit": "bytes", "elapsed_s": 2.0}},
    {"id": "tiny", "state": "ready", "loaded": True, "load": None},
    {"id": "Other", "state": "starting"},
]}


def test_the_model_is_found_as_the_daemon_finds_it() -> None:
    assert find_model(LISTING, "tiny") is LISTING["data"][1]
    assert find_model(LISTING, "qwen3-4b") is LISTING["data"][0]  # short name, any case
    assert find_model(LISTING, "OTHER") is LISTING["data"][2]
    assert find_model(LISTING, "nope") is None
    assert find_model({"data": "junk"}, "tiny") is None


def test_load_progress_becomes_the_spinner_text() -> None:
    weights = load_status(LISTING, "org/Qwen3-4B")
    assert weights == LoadStatus("starting", "weights", 1_200_000_000, 2_400_000_000, "bytes")
    assert wait_text("qwen", weights, 3.21) == "loading qwen: reading weights 1.2 GB / 2.4 GB · 3.2 s"
    assert wait_text("tiny", load_status(LISTING, "tiny"), 0.2) == "waiting for tiny · 200 ms"
    assert wait_text("o", load_status(LISTING, "Other"), 1.0) == "starting o · 1.0 s"  # no `load` field yet
    spawn = LoadStatus("starting", "spawn", 0, None, None)
    assert wait_text("m", spawn, 0.5) == "loading m: starting the engine · 500 ms"
    tokenizer = LoadStatus("starting", "tokenizer", 3, 10, None)
    assert wait_text("m", tokenizer, 0.5) == "loading m: loading the tokenizer 3 / 10 · 500 ms"
    assert wait_text("m", None, 61) == "waiting for m · 1 m 01 s"


def test_the_one_shot_prompt_is_the_words_then_stdin() -> None:
    assert compose_prompt(("what", "is", "this?"), None) == "what is this?"
    assert compose_prompt((), None) is None  # a terminal and no PROMPT: interactive
    assert compose_prompt(("Sum it up:",), "some text\n") == "Sum it up:\n\nsome text"
    assert compose_prompt((), "hi\n") == "hi"
    with pytest.raises(click.UsageError, match="nothing to ask"):
        compose_prompt((), " \n")


def test_a_401_says_which_variable_to_set() -> None:
    refused = HTTPFailure(401, "Missing or invalid API key.")
    assert describe_error(refused, "http://h", None) == (
        "mlxd at http://h needs a key: set MLXD_API_KEY (server said: Missing or invalid API key.)")
    assert describe_error(refused, "http://h", "MLXD_API_KEY") == (
        "mlxd at http://h refused the key in $MLXD_API_KEY (server said: Missing or invalid API key.)")
    assert describe_error(HTTPFailure(404, "Model 'x' not found. Available: a"), "http://h", None) == (
        "Model 'x' not found. Available: a")


def test_model_text_cannot_drive_the_terminal() -> None:
    assert "a\x1b[2Jb\rc\td\ne\x9bf\x07".translate(CONTROLS) == "a[2Jbc\td\nef"


def test_plain_output_marks_the_reasoning_and_hides_it_unless_asked() -> None:
    def shown(show_reasoning: bool) -> str:
        out = io.StringIO()
        view = AnswerView(Console(file=out, force_terminal=False), show_reasoning=show_reasoning)
        answer = Answer(started=0.0)
        view.begin()
        for n, line in enumerate(['{"choices": [{"delta": {"reasoning_content": "Let me see."}}]}',
                                  '{"choices": [{"delta": {"content": "Four.\\u001b"}}]}']):
            for piece in answer.feed(chunk(line), float(n)):
                view.show(piece)
        view.finish(answer)
        return out.getvalue()

    assert shown(False) == "Four.\x1b\n"  # piped output is left as the model wrote it
    assert shown(True) == "Thinking...\nLet me see.\n\n...done thinking.\n\nFour.\x1b\n"
