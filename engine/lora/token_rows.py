"""An adapter's own rows of the embedding and the LM head, as its files hold them: PEFT's
``modules_to_save`` tables and ``trainable_token_indices`` rows, read and checked against
its config and the base model (``engine/lora/tokens.py`` keeps them on the device)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from loramux.engine.lora.adapter_checks import fits
from loramux.engine.lora.adapter_config import CONFIG_FILE, AdapterConfig, AdapterError
from loramux.engine.model.config import ModelConfig

# modules_to_save's whole tables (base_model.model.lm_head.weight), trainable_token_indices'
# rows (base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta)
_TOKEN_KEY = re.compile(
    r"^(?:base_model\.model\.)?(model\.embed_tokens|lm_head)\."
    r"(?:(?:modules_to_save\.[\w-]+\.)?(weight)|token_adapter\.(trainable_tokens_delta)(?:\.[\w-]+)?)$"
)


@dataclass
class TokenRows:
    """Rows of the embedding or the LM head an adapter replaces (PEFT's modules_to_save:
    the whole table; trainable_token_indices: a few rows)."""

    rows: torch.Tensor  # [k, hidden]
    ids: tuple[int, ...] | None = None  # the token of each row; None: all, in order

    @property
    def count(self) -> int:
        return self.rows.shape[0]


def parse_token_tensor_name(name: str) -> tuple[str, str] | None:
    """(``embed_tokens`` or ``lm_head``, ``table`` or ``rows``) of a modules_to_save table or
    a trainable_token_indices tensor; None for any other name."""
    match = _TOKEN_KEY.match(name)
    if match is None:
        return None
    module = "lm_head" if match[1] == "lm_head" else "embed_tokens"
    return module, "table" if match[2] else "rows"


def token_rows_of(
    tensors: dict[tuple[str, str], torch.Tensor],
    config: AdapterConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device,
) -> tuple[TokenRows | None, TokenRows | None]:
    """The embedding's and the head's rows the adapter replaces, checked against its config
    and the base model. PEFT ties trainable tokens of a tied embedding to the head; a whole
    embedding saved without ``ensure_weight_tying`` leaves the head as it is."""
    vocab, hidden = model_config.vocab_size, model_config.hidden_size
    indices = dict(config.trainable_tokens)
    found: dict[str, TokenRows] = {}
    for (module, kind), tensor in sorted(tensors.items()):
        name = f"{module} ({'modules_to_save' if kind == 'table' else 'trainable_token_indices'})"
        if kind == "table":
            if module not in config.modules_to_save:
                raise AdapterError(
                    f"the weights hold a whole {module} table, but {CONFIG_FILE} does not list "
                    f"it in modules_to_save; save the adapter with the config PEFT wrote for it"
                )
            ids, expected = None, (vocab, hidden)
            if tensor.ndim == 2 and tensor.shape[1] == hidden and tensor.shape[0] != vocab:
                raise AdapterError(
                    f"{name} has {tensor.shape[0]} rows, the base model's vocabulary "
                    f"{vocab}: a resized vocabulary is not served; give new tokens ids "
                    "within the base vocabulary (its reserved tokens) and train them with "
                    "trainable_token_indices"
                )
        else:
            ids = indices.get(module)
            if ids is None:
                raise AdapterError(
                    f"the weights hold trainable token rows of {module}, but {CONFIG_FILE}'s "
                    "trainable_token_indices names none for it"
                )
            if max(ids) >= vocab:
                raise AdapterError(
                    f"trainable_token_indices names token {max(ids)}, beyond the base "
                    f"model's vocabulary of {vocab}"
                )
            expected = (len(ids), hidden)
        if tuple(tensor.shape) != expected:
            raise AdapterError(
                f"{name} has shape {tuple(tensor.shape)}; the base model needs {list(expected)}"
            )
        if module in found:
            raise AdapterError(f"{module} is both saved whole and given trainable tokens")
        if not fits(float(tensor.abs().max()), dtype):
            raise AdapterError(
                f"{name} holds NaN, infinite or values beyond "
                f"{str(dtype).removeprefix('torch.')}'s range"
            )
        found[module] = TokenRows(rows=tensor.to(device=device, dtype=dtype), ids=ids)
    for module in config.modules_to_save:
        if module not in found:
            raise AdapterError(
                f"modules_to_save lists {module}, but the weights hold no table of it"
            )
    for module in indices:
        if module not in found:
            raise AdapterError(
                f"trainable_token_indices names tokens of {module}, but the weights hold none"
            )
    embed, head = found.get("embed_tokens"), found.get("lm_head")
    if (
        head is None
        and embed is not None
        and embed.ids is not None
        and model_config.tie_word_embeddings
    ):
        head = embed
    return embed, head
