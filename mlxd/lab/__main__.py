"""`python -m mlxd.lab JOB_DIR`: run the job described in JOB_DIR/job.json (worker.py), with
OpenBLAS preloaded on a Linux CPU and MLX's settings as the engine has them."""

import sys

from mlxd.engine import blas, mlx_env

blas.reexec_with_openblas(["-m", "mlxd.lab", *sys.argv[1:]])  # the same pid: the job's record stays true
mlx_env.apply()  # before mlx is imported

from mlxd.lab.worker import main  # noqa: E402  (after the re-exec: imports mlx)

sys.exit(main(sys.argv[1:]))
