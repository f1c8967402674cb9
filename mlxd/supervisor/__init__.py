"""mlxd.supervisor."""
