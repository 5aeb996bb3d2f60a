"""How users reach the engine besides the patch: ``LLM`` (vLLM's offline API) in ``llm.py``."""
