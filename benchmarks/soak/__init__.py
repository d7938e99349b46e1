"""The soak study."""
