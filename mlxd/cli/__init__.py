"""mlxd.cli."""
