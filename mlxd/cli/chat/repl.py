"""`mlxd run`'s interactive mode: a `>>> ` prompt (prompt_toolkit), slash commands, streamed answers."""

from __future__ import annotations

from prompt_toolkit import PromptSession
from prompt_toolkit.formatted_text import FormattedText
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from rich.console import Console

from mlxd.cli.admin.client import AdminError
from mlxd.cli.chat.commands import (
    HELP,
    Command,
    CommandError,
    closed_block,
    is_command,
    opens_block,
    parse_command,
)
from mlxd.cli.chat.images import ImageError, image_path
from mlxd.cli.chat.session import AnswerView, Conversation, Target, stream_answer

PLACEHOLDER = FormattedText([("#888888", "Send a message (/? for help)")])
EXIT_HINT = "Use Ctrl + d or /bye to exit."


def make_key_bindings() -> KeyBindings:
    """Alt-Enter (Esc, Enter) inserts a newline; Ctrl-C clears a typed line, or leaves an empty prompt."""
    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    @bindings.add("c-c")
    def _interrupt(event: KeyPressEvent) -> None:
        if event.current_buffer.text:
            event.current_buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt())

    return bindings


class Repl:
    """The prompt loop; `run()` returns the exit code."""

    def __init__(self, target: Target, conversation: Conversation, console: Console) -> None:
        self.target, self.conversation, self.console = target, conversation, console
        self.view = AnswerView(console, show_reasoning=True, stats=console, wait=console)
        self.session: PromptSession[str] = PromptSession(key_bindings=make_key_bindings())

    def run(self) -> int:
        """Read and answer messages until /bye or Ctrl-D."""
        while True:
            try:
                text = self.read_message()
            except KeyboardInterrupt:
                self.say(EXIT_HINT)
                continue
            except EOFError:
                return 0
            if not text.strip():
                continue
            if is_command(text):
                if self.do_command(text) == "bye":
                    return 0
                continue
            self.ask(text)

    def read_message(self) -> str:
        """One message: a line, or a `\"\"\"` block of several."""
        first = self.session.prompt(">>> ", placeholder=PLACEHOLDER)
        if not opens_block(first):
            return first
        lines = [first]
        while (message := closed_block(lines)) is None:
            lines.append(self.session.prompt("... "))
        return message

    def do_command(self, text: str) -> str:
        """Do a slash command; its verb."""
        try:
            command = parse_command(text)
        except CommandError as exc:
            self.say(str(exc))
            return "error"
        self.apply(command)
        return command.verb

    def apply(self, command: Command) -> None:
        settings = self.conversation.settings
        if command.verb == "clear":
            self.conversation.clear()
            self.say("Cleared the conversation.")
        elif command.verb == "system":
            settings.system = command.value
            self.say("Set the system message.")
        elif command.verb == "parameter":
            settings.params[command.name] = command.value
            self.say(f"Set parameter '{command.name}' to '{command.value}'.")
        elif command.verb == "show":
            self.say(settings.describe(self.target.model, self.conversation.num_turns))
        elif command.verb == "help":
            self.say(HELP)
        elif command.verb == "image":
            try:
                path = image_path(command.value)
            except ImageError as exc:
                self.say(str(exc))
                return
            self.conversation.pending.append(path)
            self.say(f"Added image {path} (it goes with your next message).")

    def ask(self, question: str) -> None:
        """Stream the answer; keep the turn unless it failed."""
        try:
            answer, interrupted = stream_answer(self.target, self.conversation, question, self.view)
        except (AdminError, ImageError) as exc:
            self.view.end_line()
            self.console.print(f"Error: {exc}", style="red", highlight=False, markup=False, emoji=False)
            return
        self.view.finish(answer, interrupted)

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, emoji=False)
