"""``pic serve``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn, the ``serve`` extra)."""
