"""The errors the server answers with, as OpenAI's error object:
``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""
from __future__ import annotations


class APIError(Exception):
    """A request the server refuses; ``status`` is the HTTP status of the answer."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
