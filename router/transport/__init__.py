"""The router's side of the shard transport: a client to every rank, and reaching warmed-up shards."""
