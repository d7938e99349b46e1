"""The structured overhead study."""
