"""API errors as values: one exception type, rendered in OpenAI's error format."""

from __future__ import annotations

import re

import msgspec


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class APIError(Exception):
    """An error that reaches the client as JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_openai(self) -> ErrorBody:
        """The body in OpenAI's `{"error": {...}}` shape."""
        return ErrorBody(ErrorDetail(self.message, self.type, self.param, self.code))


_PATH = re.compile(r" - at `\$((?:\.[A-Za-z_]\w*|\[[^\]]*\])*)`$")


def param_from_path(path: str) -> str | None:
    """`$.messages[0].content` -> `messages[0].content`; `` (root) -> None."""
    return path.lstrip(".") or None


def from_decode_error(exc: msgspec.MsgspecError) -> APIError:
    """A 400 naming the offending field, from a msgspec decode/validation error."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        match = _PATH.search(text)
        param = param_from_path(match.group(1)) if match else None
        message = f"Invalid value for '{param}': {text}" if param else f"Invalid request: {text}"
        return APIError(400, message, param=param, code="invalid_value")
    return APIError(400, f"Request body is not valid JSON: {text}", code="invalid_json")


def encode_openai_error(err: APIError) -> bytes:
    """JSON bytes of an APIError in OpenAI's format."""
    return msgspec.json.encode(err.to_openai())
