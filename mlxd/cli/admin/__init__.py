"""The admin commands (`mlxd models|ps|load|unload|drain|lease`) and their client."""
