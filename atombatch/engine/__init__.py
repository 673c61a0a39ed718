"""The engine: the `Batcher` facade (`batcher.py`), the overlap pipeline (`pipeline.py`), the
scheduler and the KV manager, requests' data, outputs, n > 1 groups, hybrid checkpoints, PD intake
and the asyncio adapter (`aio.py`)."""
