"""OpenAI-compatible HTTP server (FastAPI) over vLLM's async engine."""
