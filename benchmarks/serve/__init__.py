"""The serve study."""
