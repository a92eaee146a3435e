"""KV movement into and out of engines, all through vLLM's KV-connector API (one bridge)."""
