"""Environment names of the engine's settings, and the old names that still work.

Two families, told apart by their names:

* **engine tuning** (``LORAMUX_ENGINE_<FIELD>``): how the engine runs, wherever it runs (in
  the platform's process or as ``loramux engine``): memory budgets, batch limits, dtype;
* **the engine server** (``LORAMUX_ENGINE_SERVER_<NAME>``): the ``loramux engine``
  process itself: where it listens, its name and heartbeat in the registry, its secret.

Every other setting is ``LORAMUX_<FIELD>``. Before this scheme the tuning settings were
``LORAMUX_<FIELD>`` and the server's ``LORAMUX_ENGINE_<NAME>``: those names are still
read (a name of the new scheme wins over an old one), each with a :class:`DeprecatedSetting`
warning that names its replacement.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from pydantic_settings import PydanticBaseSettingsSource

from loramux.platform.settings_engine import PART_OF, nest

# Settings fields that tune the engine (``settings_engine``'s): LORAMUX_ENGINE_<FIELD>.
ENGINE_TUNING_FIELDS = tuple(PART_OF)
# Settings fields of the engine server: LORAMUX_ENGINE_SERVER_<NAME>.
ENGINE_SERVER_FIELDS = (
    "engine_id",
    "engine_host",
    "engine_port",
    "engine_advertise_url",
    "engine_secret",
    "engine_heartbeat_s",
)


def env_name(field: str) -> str:
    """The environment variable that sets the ``Settings`` field ``field``."""
    if field in ENGINE_TUNING_FIELDS:
        return f"LORAMUX_ENGINE_{field.upper()}"
    if field in ENGINE_SERVER_FIELDS:
        return f"LORAMUX_ENGINE_SERVER_{field.removeprefix('engine_').upper()}"
    return f"LORAMUX_{field.upper()}"


def old_env_name(field: str) -> str | None:
    """The name ``field`` had before the two families were named, if it differs."""
    if field in ENGINE_TUNING_FIELDS or field in ENGINE_SERVER_FIELDS:
        return f"LORAMUX_{field.upper()}"
    return None


class DeprecatedSetting(FutureWarning):
    """A setting was given under its old name (shown by default: it is for operators)."""


class EngineEnvNames(PydanticBaseSettingsSource):
    """Reads the engine's settings under their names and warns about old names in use.

    Placed before pydantic-settings' own environment source, which reads every top-level
    field as ``LORAMUX_<FIELD>`` and so still picks up an engine server's old name (a new
    name set too wins); the engine's tuning settings, nested, are read here under both
    names and handed over as ``{"engine": {part: {field: value}}}``."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ reads every field at once

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        tuning: dict[str, Any] = {}
        for field in ENGINE_TUNING_FIELDS + ENGINE_SERVER_FIELDS:
            new, old = env_name(field), old_env_name(field)
            into = tuning if field in PART_OF else values
            if new in os.environ:
                into[field] = os.environ[new]
            if old is not None and old in os.environ:
                ignored = " (ignored: it is set too)" if new in os.environ else ""
                warnings.warn(
                    f"{old} is deprecated: set {new} instead{ignored}",
                    DeprecatedSetting,
                    stacklevel=2,
                )
                # The engine's settings are nested: pydantic's own source no longer reads
                # their old flat names, so the old name is read here (the new one wins).
                if field in PART_OF and new not in os.environ:
                    tuning[field] = os.environ[old]
        if tuning:
            values["engine"] = nest(tuning)
        return values
