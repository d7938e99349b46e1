"""Adapter ingest: unpack an uploaded archive safely, then validate the adapter in it.

``unpack_adapter_archive`` turns a .tar.gz / .zip upload into a folder holding
``adapter_config.json`` and ``adapter_model.safetensors``; ``validate_adapter_dir`` checks
such a folder against the base model and returns an ``AdapterInfo``. Both refuse bad
uploads with ``UploadRejected``, whose message is meant for the uploader.
"""

from loramux.platform.ingest.archive import unpack_adapter_archive
from loramux.platform.ingest.errors import UploadRejected
from loramux.platform.ingest.validate import AdapterInfo, validate_adapter_dir

__all__ = ["AdapterInfo", "UploadRejected", "unpack_adapter_archive", "validate_adapter_dir"]
