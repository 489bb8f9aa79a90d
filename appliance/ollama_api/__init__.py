"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`) on the same
port as the OpenAI one: an adapter onto the same internal request. An Ollama body is translated into the OpenAI chat
or completions body it means and checked by the same validation (so every bound of appliance/limits.py holds); the
engine's events are spelled as Ollama's NDJSON lines. docs/ollama.md says what is supported, ignored and refused."""
