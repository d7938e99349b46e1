"""The grammar engines study."""
