"""The base of every compatible API's request models (OpenAI, Anthropic, Responses): unknown fields are accepted and
kept, not refused, as vLLM's request models do, so a client that sends a newer field keeps working."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Lenient(BaseModel):
    """Unknown fields are kept (``model_extra``) rather than refused, as vLLM's request models do."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
