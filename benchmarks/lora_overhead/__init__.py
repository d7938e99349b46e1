"""The lora overhead study."""
