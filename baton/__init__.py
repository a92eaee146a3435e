"""Baton: serving LLM conversations on Ray Serve + vLLM behind an OpenAI-compatible API."""

__version__ = "0.1.0"
