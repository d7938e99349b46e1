"""The grammar cache memory study."""
