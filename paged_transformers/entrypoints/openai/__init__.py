"""The OpenAI-compatible server (``api_server``); needs the ``[serve]`` extra (FastAPI, uvicorn, pydantic,
prometheus-client)."""
