"""Pydantic models of what our own layer answers: OpenAI-shaped errors and the profiling
endpoints. The OpenAI endpoints' bodies are vLLM's models (openai_api.py)."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # OpenAI's schema: a string or null


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ProfileStarted(BaseModel):
    directory: str


class ProfileFiles(BaseModel):
    trace: str
    operators: str


class ProfileStopped(BaseModel):
    files: list[ProfileFiles]  # one pair per engine rank
