"""Llama-family decoder over the paged KV cache, and weight loading."""
