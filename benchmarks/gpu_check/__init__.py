"""The gpu check study."""
