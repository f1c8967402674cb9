"""`python -m mlxd.engine --model DIR --model-id ID --socket PATH`: one model on a Unix socket."""

from __future__ import annotations

import logging
import os
import sys

from mlxd.engine import blas
from mlxd.engine.parent_watch import set_death_signal


def main() -> None:
    """Entry point: maybe re-exec with OpenBLAS, then serve; exit with a named code."""
    # Before anything slow: remember our parent and ask for SIGTERM when it dies (the setting
    # survives the re-exec), so a parent that dies while we start is noticed too.
    os.environ.setdefault("MLXD_PARENT_PID", str(os.getppid()))
    set_death_signal()
    blas.reexec_with_openblas(["-m", "mlxd.engine", *sys.argv[1:]])
    from mlxd.engine.server import serve  # after the re-exec: this imports mlx
    from mlxd.engine.settings import parse_args

    settings = parse_args(sys.argv[1:])
    logging.basicConfig(
        level=os.environ.get("MLXD_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    code = serve(settings)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # The GPU thread may still be inside an MLX call; don't wait for it at interpreter exit.
    os._exit(code)


if __name__ == "__main__":
    main()
