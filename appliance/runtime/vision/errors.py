"""The one refusal of the image path, importable without Pillow or OpenVINO (the server's admission catches it for
every model, text-only ones included)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


class ImageRejected(ValueError):
    """An image the server will not read: the message is for the client (format, corrupt or truncated, too large).
    `image`: which of the prompt's images (its index in PromptSpec.images), so the refusal can name the client's
    field; None when it is about all of them (the placeholders)."""

    def __init__(self, message: str, image: int | None = None):
        super().__init__(message)
        self.image = image

    @classmethod
    def placeholders(cls, images: int, places: int) -> ImageRejected:
        """The request's images are not the image places its chat template wrote (both schemes' check)."""
        return cls(
            f"the request has {images} image(s) but its chat prompt has {places} image place(s): each image must "
            "be a content part of a message"
        )


def each_image(read: Callable[[T], R], images: Iterable[T]) -> list[R]:
    """[read(image) for image in images], an ImageRejected raised for the i-th made about image i (unless it names
    one already): the one place a refusal is attributed to its image, so the client's field can be named."""
    out = []
    for i, image in enumerate(images):
        try:
            out.append(read(image))
        except ImageRejected as exc:
            if exc.image is None:
                exc.image = i
            raise
    return out
