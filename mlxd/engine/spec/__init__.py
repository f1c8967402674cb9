"""Speculative decoding: drafts for a row, checked by the target model in one pass.

- `ngram.py`: model-free drafts from the row's own context (prompt lookup).
- `drafters.py`: drafts from a draft model or the model's own first layers, and what a
  model drafts with, opened (and checked) at load.
- `accept.py`: which drafts a row keeps (greedy agreement; rejection sampling keeps the
  target's distribution).
- `pace.py`: per row, how long drafts are and whether drafting pays right now.
- `serial.py`: the serial lane's decoder for a row that drafts (plain steps a pass ahead
  when it has no drafts, verification when it has).
- `batch.py`: the batch lane's step with drafts (every row's drafts in one pass, each row's
  KV rolled back by its own count).
- `draft_batch.py`: a draft model's batch KV, kept in step with the batch's rows.
- `holes.py`: the batch KV whose rows' refused drafts stay as masked holes.
- `width.py`: how wide a batch's verification pass pays to be.
- `config.py`: what a model drafts with (`--draft`, `--num-draft-tokens`).
"""
