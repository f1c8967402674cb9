"""Engine groups: one model over several processes with mx.distributed (docs/distributed.md)."""
