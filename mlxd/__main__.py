"""`python -m mlxd` is the `mlxd` command."""

from mlxd.cli.main import main

main()
