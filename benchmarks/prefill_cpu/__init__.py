"""The prefill cpu study."""
