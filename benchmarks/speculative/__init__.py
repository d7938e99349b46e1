"""The speculative study."""
