"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx status for bad input.

Every failure a client can cause maps to an `ApiError`; the routes never let one become a 5xx.
A 5xx body names no internals (no exception, path or engine message): the server's log has those.
`kind` is the label of `kvledger_errors_total`.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        assert 400 <= status < 600
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @property
    def kind(self) -> str:
        return self.code or self.type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer KEY` with a configured key.",
                    "authentication_error", None, "invalid_api_key")


def forbidden() -> ApiError:
    return ApiError(403, "This endpoint needs an operator key (an entry of the key file with "
                    '"role": "operator"); a tenant\'s key cannot read it.', "permission_error", None,
                    "operator_key_required")


def too_many(limit: int) -> ApiError:
    return ApiError(429, f"Too many concurrent requests for this API key (limit {limit}); retry later.",
                    "rate_limit_error", None, "rate_limit_exceeded")


def model_not_found(name: str, served: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist; this server serves `{served}`.",
                    "invalid_request_error", "model", "model_not_found")


def internal_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request; its log has the detail.",
                    "server_error", None, "internal_error")


def engine_error() -> ApiError:
    return ApiError(500, "The engine failed while running this request; the server's log has the detail.",
                    "server_error", None, "engine_error")
