"""The top of the worker process: the app that registers every client API (app.py) and their OpenAPI document
(openapi.py). The only package that imports every adapter (tests/test_architecture.py)."""
