"""The engine core in its own process (docs/architecture.md).

The core owns the device loop and nothing else: scheduler, step kernel, runtime and sampler. A
front (the HTTP server, or any asyncio embedder through `CoreClient`) parses, validates,
tokenizes, detokenizes and streams. They exchange msgspec messages over ZeroMQ IPC: requests and
aborts in, one message per engine step out, carrying that step's plain decode tokens as an array.
"""

from atombatch.core.client import CoreClient
from atombatch.core.messages import Abort, CoreMessage, Failed, FrontMessage, Ready, Shutdown, Step, Submit

__all__ = ["Abort", "CoreClient", "CoreMessage", "Failed", "FrontMessage", "Ready", "Shutdown",
           "Step", "Submit"]
