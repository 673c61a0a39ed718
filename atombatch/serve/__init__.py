"""OpenAI-compatible HTTP/SSE serving of one artifact: `python -m atombatch.serve`.

    from atombatch.serve import create_app
    app = create_app(batcher, "my-model")        # a Starlette app; run it with uvicorn

See docs/server.md for the endpoints, the extension fields and the metrics.
"""

from atombatch.serve.app import ApiError, create_app
from atombatch.serve.cli import DEFAULT_SPEC, build_engine, main
from atombatch.serve.tokens import HFCodec, IdCodec

__all__ = ["DEFAULT_SPEC", "ApiError", "HFCodec", "IdCodec", "build_engine", "create_app", "main"]
