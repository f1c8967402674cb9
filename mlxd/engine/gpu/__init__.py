"""The GPU thread: gateway, lanes, sequence, sampling, tickets."""
