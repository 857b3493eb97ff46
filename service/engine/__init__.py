"""The engine: admission and queues, batching into the graph pool, and the processes that run it."""
