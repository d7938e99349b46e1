"""The cold adapter flood study."""
