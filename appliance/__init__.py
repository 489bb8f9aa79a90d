"""The appliance: an edge LLM inference runtime and OVMS-compatible OpenAI server."""

__version__ = "0.1.0"
