"""Serving processes: one engine process (the model, continuous batching, metrics) and gunicorn HTTP workers
that reach it over a Unix socket. See docs/serving.md for why."""
