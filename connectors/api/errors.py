"""The API's refusals: `ApiError` (status, machine-readable code, message) and `invalid_input`,
the refusal of hostile or invalid input with the reason the core gives a run it fails for it.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from agentruns.connectors.errors import AgentrunsError


class ApiError(AgentrunsError):
    """An HTTP-level refusal: status code, machine-readable ``code`` and a message."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.extra = extra

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": self.code, "detail": str(self), **self.extra}, status_code=self.status
        )


def invalid_input(status: int, code: str, reason: str, **extra: Any) -> ApiError:
    """A refusal of hostile or invalid input: `reason` is `invalid_input:<what>: detail`, the
    same reason the core gives a run it fails for it."""
    return ApiError(status, code, reason, reason=reason, **extra)
