"""The engines: the pool, each engine process, policy, the spare, leases and the one engine client."""
