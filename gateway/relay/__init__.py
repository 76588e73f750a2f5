"""The relay to the engine: the pooled client and the SSE stream relay."""
