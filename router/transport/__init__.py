"""The router's side of the shard transport: a client to every rank, reaching warmed-up shards, and the plain records
its calls take and return (records.py), which wire.py alone turns into the shard protocol's messages and back."""
