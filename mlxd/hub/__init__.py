"""Pulling models from the Hugging Face hub (used by the CLI)."""
