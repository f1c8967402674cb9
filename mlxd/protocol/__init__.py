"""mlxd.protocol."""
