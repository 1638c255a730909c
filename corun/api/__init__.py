"""The OpenAI-compatible server: ``create_app(engine, tokenizer, ...)``; run it with
``python -m corun.serve``."""

from corun.api.server import create_app

__all__ = ["create_app"]
