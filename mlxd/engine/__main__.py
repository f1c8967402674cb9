"""`python -m mlxd.engine --model DIR --model-id ID --socket PATH`: one model on a Unix socket.

`python -m mlxd.engine --spare` imports everything, then reads that command line (a JSON list)
from stdin: the supervisor keeps one such spare so a model starts by loading only.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from setproctitle import setproctitle

from mlxd.engine import blas, mlx_env
from mlxd.engine.parent_watch import set_death_signal
from mlxd.fdlimit import raise_open_file_limit
from mlxd.protocol.exit_codes import ExitCode
from mlxd.protocol.process import SPARE_FLAG, SPARE_READY


def wait_for_assignment() -> list[str]:
    """A spare engine's command line, as one JSON list on stdin; exit when the parent goes first."""
    print(SPARE_READY, flush=True)  # the supervisor now knows a start costs only the load
    line = sys.stdin.readline()
    try:
        argv = json.loads(line) if line else None
    except ValueError:
        argv = None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        os._exit(ExitCode.PARENT_GONE if not line else ExitCode.ENGINE_BOOT_ERROR)
    return argv


def main() -> None:
    """Entry point: maybe re-exec with OpenBLAS, then serve; exit with a named code."""
    # Before anything slow: remember our parent and ask for SIGTERM when it dies (the setting
    # survives the re-exec), so a parent that dies while we start is noticed too.
    os.environ.setdefault("MLXD_PARENT_PID", str(os.getppid()))
    set_death_signal()
    blas.reexec_with_openblas(["-m", "mlxd.engine", *sys.argv[1:]])
    mlx_settings = mlx_env.apply()  # before mlx is imported: MLX reads its settings once
    from mlxd.engine.server import serve  # after the re-exec: this imports mlx

    # After mlx-lm's import, which sets the limit to (2048, 4096) (mlx_lm/utils.py): the soft
    # limit goes back up, as far as the hard limit mlx-lm left.
    raise_open_file_limit()
    from mlxd.engine.settings import parse_args

    argv = sys.argv[1:]
    if argv == [SPARE_FLAG]:  # a spare: imports are done; wait for the model to serve
        setproctitle("mlxd engine (spare)")
        argv = wait_for_assignment()
    settings = parse_args(argv)
    # `ps` then names the model, also for an engine that began as a spare (its argv says --spare).
    setproctitle(f"mlxd engine {settings.model_id}")
    logging.basicConfig(
        level=os.environ.get("MLXD_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if mlx_settings:
        logging.getLogger("mlxd.engine").info("MLX settings: %s", " ".join(f"{k}={v}" for k, v in mlx_settings.items()))
    if from_env := mlx_env.given(os.environ, mlx_settings):
        logging.getLogger("mlxd.engine").info("MLX settings from the environment: %s",
                                              " ".join(f"{k}={v}" for k, v in from_env.items()))
    code = serve(settings)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # The GPU thread may still be inside an MLX call; don't wait for it at interpreter exit.
    os._exit(code)


if __name__ == "__main__":
    main()
