"""The router's core: requests waiting and running, the batching policy, the KV blocks and prefix cache, and the
loop that drives the shards step by step. No HTTP or gRPC front door here."""
