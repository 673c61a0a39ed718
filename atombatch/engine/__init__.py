"""The engine: the `Batcher` facade (`batcher.py`), its synchronous step (`step.py`), the overlap
pipeline with its planning ahead (`pipeline.py`), the scheduler and the KV manager, requests' data,
outputs, n > 1 groups, hybrid checkpoints, PD intake and the asyncio adapter (`aio.py`)."""
