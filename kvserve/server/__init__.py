"""The OpenAI-compatible HTTP server: `kvserve serve`."""
