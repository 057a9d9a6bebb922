"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

`app` holds the routes and request validation, `async_engine` the engine thread that owns
the `LLMEngine`, `protocol` the OpenAI wire format, `metrics` the Prometheus registry, and
`cli` the `pagedkv serve` command.

    from pagedkv.server import create_app
    app = create_app(engine, served_model_name="SmolLM2-135M-Instruct", api_key=None)
"""

from pagedkv.server.app import create_app

__all__ = ["create_app"]
