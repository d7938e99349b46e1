"""An adapter version's files in the object store, as engines are told to fetch them.

The platform stores every upload content-addressed; an engine (in-process or a separate
``loramux engine`` process with the same store settings) builds a source that reads the
two files back, verified, on its loader thread when a request needs the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loramux.engine import CONFIG_FILE, WEIGHTS_FILE, CallableSource
from loramux.platform.store import ObjectStore


@dataclass(frozen=True)
class StoredAdapter:
    config_key: str  # store key of adapter_config.json
    weights_key: str  # store key of adapter_model.safetensors
    sha256: str  # of the version's files (the disk cache's content id)
    description: str  # what errors and logs call it, e.g. "version <id>"

    def source(self, store: ObjectStore) -> CallableSource:
        """A source reading the two files from ``store`` (checksums verified on read)."""

        def fetch(folder: Path) -> None:
            store.read_to(self.config_key, folder / CONFIG_FILE)
            store.read_to(self.weights_key, folder / WEIGHTS_FILE)

        return CallableSource(
            fetch,
            description=f"{self.description} (store object {self.weights_key})",
            cache_key=self.sha256,
        )
