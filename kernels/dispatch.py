"""Which kernels an engine runs, decided once where the engine is built.

* ``auto`` (default): the Triton kernels on CUDA, the torch implementations elsewhere;
* ``torch`` (also accepted under its old name ``reference``): the torch implementations,
  also on CUDA (to bisect a suspected kernel bug);
* ``triton``: the Triton kernels on any device. On CPU tensors that only works in
  Triton's interpreter (``TRITON_INTERPRET=1`` set before the first kernel is defined):
  the tests use it to run the engine's Triton path on a machine without a GPU.

No op reads this: the engine resolves the choice to a backend
(``loramux.engine.lora.backend``) and hands that to whatever runs ops. Triton modules are
imported only by the Triton backend, so CPU-only installs never import triton.
"""

from __future__ import annotations

import torch

KERNELS_ENV = "LORAMUX_KERNELS"
KERNEL_CHOICES = ("auto", "torch", "triton")
_ALIASES = {"reference": "torch"}


def resolve_kernels(choice: str | None, device: torch.device | str) -> str:
    """``"torch"`` or ``"triton"`` for ``choice`` (None or blank: ``auto``) on ``device``.

    A ValueError names the accepted choices.
    """
    name = (choice or "").strip().lower() or "auto"
    name = _ALIASES.get(name, name)
    if name not in KERNEL_CHOICES:
        raise ValueError(
            f"{KERNELS_ENV}={choice!r} is not one of {', '.join(KERNEL_CHOICES)} "
            "('reference' is accepted for 'torch')"
        )
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return name
