"""The tensor parallel study."""
