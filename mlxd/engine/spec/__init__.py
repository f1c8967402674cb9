"""Speculative decoding: drafts for a row, checked by the target model in one pass.

- `ngram.py`: model-free drafts from the row's own context (prompt lookup).
- `accept.py`: which drafts a row keeps (greedy agreement; rejection sampling keeps the
  target's distribution).
- `pace.py`: per row, how long drafts are and whether drafting pays right now.
- `serial.py`: the serial lane's decoder for a row that drafts (plain steps a pass ahead
  when it has no drafts, verification when it has).
- `batch.py`: the batch lane's step with drafts (every row's drafts in one pass, each row's
  KV rolled back by its own count).
- `config.py`: what a model drafts with (`--draft`, `--num-draft-tokens`).
"""
