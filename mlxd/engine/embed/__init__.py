"""Embedding models: loaded with mlx-embeddings, pooled as their sentence-transformers files say,
batched on the engine's GPU thread (gateway.py), served at /v1/embeddings (routes.py)."""
