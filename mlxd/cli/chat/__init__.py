"""`mlxd run`: chat with a model in the terminal."""
