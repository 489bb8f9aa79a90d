"""One error type for the whole HTTP edge, rendered as the OpenAI error object.

OVMS answers 400/412 with `{"error": "Mediapipe execution failed. ..."}`; we keep its messages but use
`{"error": {"message", "type", "param", "code"}}` and plain statuses, which is what OpenAI clients parse.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance import error_shapes

# status -> (type, default code). Types follow the OpenAI API so client libraries classify errors right.
_KINDS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
}


@dataclass
class ApiError(Exception):
    """Raised anywhere below the route handlers; the app turns it into a JSON response."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str | None = None

    def __post_init__(self) -> None:
        Exception.__init__(self, self.message)
        kind, code = _KINDS.get(self.status, ("server_error" if self.status >= 500 else "invalid_request_error", None))
        self.type = self.type or kind
        self.code = self.code or code

    def body(self) -> dict:
        return error_shapes.openai(self.message, self.type, self.param, self.code)


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 with an OVMS validation message."""
    return ApiError(400, message, param=param)
