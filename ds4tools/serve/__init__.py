"""``ds4tools serve``: an OpenAI-compatible HTTP server over the engine, with speculative
decoding (the ``serve`` extra: uvicorn, starlette, jinja2).

    app.py        the HTTP API: endpoints, streaming, errors, API key
    requests.py   request bodies checked into GenRequest (400s)
    template.py   chat templates, rendered in jinja2's sandbox as transformers does
    slots.py      the slots (one worker thread and engine each) and the bounded queue
    metrics.py    counters and their Prometheus text
    server.py     loading, binding, running under uvicorn

This package sits above the engine: it imports the engine, never the reverse.
"""
from .server import ServeOptions, load_state, serve

__all__ = ["ServeOptions", "load_state", "serve", "build_app"]


def build_app(state):
    from .app import build_app as _build
    return _build(state)
