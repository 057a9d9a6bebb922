"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

`app` holds the routes and the ASGI layers around them (response counts, auth, body limit),
`config` the server's limits (`ServerConfig`), `validate` turns a request into token ids and
`SamplingParams`, `async_engine` runs the engine thread that owns the `LLMEngine` and contains
failures to the requests they touch, `serving` turns outputs into JSON or server-sent events,
`protocol` is the OpenAI wire format, `metrics` the Prometheus registry, and `cli` the
`pagedkv serve` command (with its drain on shutdown and exit status on engine death).

    from pagedkv.server import ServerConfig, create_app
    app = create_app(engine, served_model_name="SmolLM2-135M-Instruct", config=ServerConfig(max_queue=64))

`create_app` loads on first use, so `pagedkv serve --help` does not import torch.
"""

from __future__ import annotations


from pagedkv.server.config import ServerConfig


def __getattr__(name: str):
    if name == "create_app":
        from pagedkv.server.app import create_app

        return create_app
    raise AttributeError(f"module 'pagedkv.server' has no attribute {name!r}")


__all__ = ["ServerConfig", "create_app"]
