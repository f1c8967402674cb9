"""`mlxd start|stop|status|logs|service`: the daemon as a background service."""
