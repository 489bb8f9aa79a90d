"""The one refusal of the image path, importable without Pillow or OpenVINO (the server's admission catches it for
every model, text-only ones included)."""

from __future__ import annotations


class ImageRejected(ValueError):
    """An image the server will not read: the message is for the client (format, corrupt or truncated, too large)."""

    @classmethod
    def placeholders(cls, images: int, places: int) -> ImageRejected:
        """The request's images are not the image places its chat template wrote (both schemes' check)."""
        return cls(
            f"the request has {images} image(s) but its chat prompt has {places} image place(s): each image must "
            "be a content part of a message"
        )
