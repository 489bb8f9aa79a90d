"""The one refusal of the image path, importable without Pillow or OpenVINO (the server's admission catches it for
every model, text-only ones included)."""


class ImageRejected(ValueError):
    """An image the server will not read: the message is for the client (format, corrupt or truncated, too large)."""
