"""`mlxd rank`: the agent on another host that starts that host's ranks of an engine group."""
