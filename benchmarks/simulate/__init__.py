"""The simulate study."""
