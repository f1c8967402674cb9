"""mlxd.engine."""
