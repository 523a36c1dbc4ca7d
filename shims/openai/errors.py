"""The error every OpenAI-style route answers with: OpenAI's shape, which the ``openai`` SDK turns into its own typed
exceptions (and ``shims.anthropic.wire`` re-shapes for the Anthropic routes)."""

from __future__ import annotations


class OpenAIError(Exception):
    """An error answered in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
