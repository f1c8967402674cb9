"""Prompt KV: RAM prefixes (SSD files to come)."""
