"""Which implementation an op runs: Triton on CUDA tensors, the torch reference elsewhere.

``LORAMUX_KERNELS`` overrides the choice everywhere:

* ``auto`` (default): Triton for CUDA tensors, the reference for the rest;
* ``reference``: the torch references, also on CUDA (to bisect a suspected kernel bug);
* ``triton``: the Triton kernels for every tensor. On CPU tensors that only works in
  Triton's interpreter (``TRITON_INTERPRET=1`` set before the first op runs): the tests
  use it to run the engine's Triton path on a machine without a GPU.

Triton modules are imported only when a Triton path is taken, so CPU-only installs never
import triton.
"""

from __future__ import annotations

import os

import torch

KERNELS_ENV = "LORAMUX_KERNELS"
KERNEL_CHOICES = ("auto", "reference", "triton")


def kernel_choice() -> str:
    """The ``LORAMUX_KERNELS`` setting (``auto`` when unset); a ValueError names the choices."""
    choice = os.environ.get(KERNELS_ENV, "").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(
            f"{KERNELS_ENV}={os.environ[KERNELS_ENV]!r} is not one of {', '.join(KERNEL_CHOICES)}"
        )
    return choice


def reference_forced() -> bool:
    return kernel_choice() == "reference"


def use_triton_on(device: torch.device | str) -> bool:
    """Whether ops on tensors of ``device`` go to the Triton kernels."""
    choice = kernel_choice()
    return choice == "triton" or (choice == "auto" and torch.device(device).type == "cuda")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether ops on ``tensor`` go to the Triton kernels."""
    choice = kernel_choice()
    return choice == "triton" or (choice == "auto" and tensor.is_cuda)
