"""The one error ingest raises for a bad upload."""

from __future__ import annotations


class UploadRejected(ValueError):
    """An upload refused as unsafe or unusable; the message is written for the uploader."""
