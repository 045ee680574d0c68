"""`ApiError`: an HTTP error in OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, with its status code."""

from __future__ import annotations

from typing import Any

from prefixq.core.errors import PrefixqError

__all__ = ["ApiError", "bad_request", "not_found"]


class ApiError(PrefixqError):
    """Raised when an HTTP request to `prefixq serve` is refused; the server answers it as
    OpenAI's API would (status code and error body)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    """400 invalid_request_error."""
    return ApiError(400, message, param=param, code=code)


def not_found(kind: str, object_id: str, *, param: str | None = None) -> ApiError:
    """404 for an unknown (or another namespace's) object, worded as OpenAI words it."""
    return ApiError(404, f"No such {kind}: {object_id!r}", param=param)
