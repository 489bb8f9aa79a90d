"""The OVMS-compatible OpenAI API: HTTP edge (Flask), request validation, response shapes, SSE."""
