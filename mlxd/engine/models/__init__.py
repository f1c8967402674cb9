"""Loading models, GGUF import, tokenizers, random test models."""
