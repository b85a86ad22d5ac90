"""The shard's gRPC service and what keeps it honest: the servicer over cached batches, the one thread that runs
all torch work, and the step watchdog behind its health."""
