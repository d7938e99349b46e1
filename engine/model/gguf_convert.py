"""Convert a GGUF Llama-family checkpoint into an HF-format directory, once.

transformers can read GGUF directly, but that dequantizes every tensor on each
start (~15 s for SmolLM2-135M) and its ``save_pretrained`` refuses a GGUF-loaded
model. So we load it once, rebuild a plain model from the config without the
``quantization_config``, copy the dequantized state dict in, and save a normal
safetensors directory next to the tokenizer (with its chat template). Later
starts load that directory in about a second.

The write is atomic: everything goes to a temporary sibling directory which is
renamed into place only when complete, so an interrupted conversion never leaves
a half-written model behind.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

# The marker written last: a directory holding it is a complete conversion.
COMPLETE_MARKER = ".converted-from-gguf"
# ... or, for a directory of the config and tokenizer only (no weights), this one.
METADATA_MARKER = ".metadata-from-gguf"


def is_converted(out_dir: Path) -> bool:
    return (out_dir / COMPLETE_MARKER).is_file()


def _plain_config(config):
    """``config`` without the GGUF quantization marker: it describes a plain checkpoint."""
    import torch

    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    plain_config = type(config).from_dict(config_dict)
    plain_config.dtype = torch.float32
    return plain_config


def _write_atomically(out_dir: Path, marker: str, gguf_file: Path, write) -> None:
    """Run ``write(tmp_dir)``, mark it complete and rename it onto ``out_dir``.

    Another process may be writing the same folder (two servers, or test workers, started
    at once on one cache): whichever finishes second keeps the first one's complete folder,
    which the first may already be reading, and drops its own.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(tmp_dir)
        (tmp_dir / marker).write_text(f"{gguf_file.name}\n")
        if (out_dir / marker).is_file():  # another writer's, done first
            return
        shutil.rmtree(out_dir, ignore_errors=True)  # a stale one from an earlier crash
        try:
            tmp_dir.rename(out_dir)
        except OSError:  # another writer's complete folder got there in between
            if not (out_dir / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # gone already once renamed


def extract_gguf_metadata(gguf_file: Path, out_dir: Path, *, log=print) -> Path:
    """Write ``gguf_file``'s config.json, generation config and tokenizer files (with the
    chat template) to ``out_dir`` unless they are there: what a process needs that counts
    tokens, renders chats and checks adapters' shapes but never runs the model (the
    platform in remote mode). No weights are read or written: about a second."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if (out_dir / METADATA_MARKER).is_file():
        return out_dir
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF model file not found: {gguf_file}")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = _plain_config(AutoConfig.from_pretrained(folder, gguf_file=name))

    def write(tmp_dir: Path) -> None:
        config.save_pretrained(tmp_dir)
        GenerationConfig.from_model_config(config).save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)

    _write_atomically(out_dir, METADATA_MARKER, gguf_file, write)
    log(f"Tokenizer and config of {gguf_file.name} saved to {out_dir} (no weights)")
    return out_dir


def convert_gguf_to_hf(gguf_file: Path, out_dir: Path, *, log=print) -> Path:
    """Write an HF-format copy of ``gguf_file`` to ``out_dir`` unless one is there.

    Returns ``out_dir``. The result holds config.json, model.safetensors (fp32),
    generation_config.json and the tokenizer files including the chat template.
    """
    gguf_file = Path(gguf_file)
    out_dir = Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF model file not found: {gguf_file}")

    # Heavy imports only when a conversion is really needed.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log(f"Converting {gguf_file.name} to an HF-format directory (once; ~20 s)...")
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = gguf_model.state_dict()
    del gguf_model

    # A fresh config without the GGUF quantization marker, so save_pretrained works
    # and the saved config describes a plain fp32 checkpoint.
    plain_config = _plain_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()

    def write(tmp_dir: Path) -> None:
        model.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)

    _write_atomically(out_dir, COMPLETE_MARKER, gguf_file, write)
    log(f"Converted model saved to {out_dir}")
    return out_dir
