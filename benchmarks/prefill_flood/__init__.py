"""The prefill flood study."""
