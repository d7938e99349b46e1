"""Running the Triton kernels on the CPU, in Triton's interpreter (tests, smoke benchmarks).

``use_cpu_interpreter()`` must run before the first ``*_triton`` module is imported:
Triton picks interpreter or compiler when ``@triton.jit`` decorates a kernel. Library code
imports those modules lazily, inside the ops, so calling this at start-up is early enough.

triton 3.6's interpreter holds every scalar as a 1-element numpy array and turns loop
bounds into ints with ``int(array)``, which numpy >= 2.4 refuses for arrays of ndim > 0
(triton-lang/triton#9171): kernels with ``range(lo, hi)`` over runtime bounds would fail.
``.item()`` reads the same value, so the interpreter's tensors get an ``__index__`` that
uses it. Only the interpreter is touched; compiled kernels never see this.
"""

from __future__ import annotations

import os


def use_cpu_interpreter() -> None:
    """Set ``TRITON_INTERPRET=1`` and make the interpreter work on numpy >= 2.4."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_loramux_item_index", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch._loramux_item_index = True
    interpreter._patch_lang_tensor = patch
