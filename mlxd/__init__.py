"""mlxd: a local LLM inference daemon on MLX."""

__version__ = "0.1.0"
