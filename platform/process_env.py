"""What a ``loramux`` process sets in its own environment before torch loads.

OpenMP (libgomp, which torch's CPU ops run on) reads its wait policy once, when it loads:
by default a thread that finishes its part of a parallel region spins until the others are
done. Beside another busy process that spinning takes the core the late thread needs, and
a step slowed several-fold (engine/compute_threads.py). ``PASSIVE`` makes waiting threads
sleep; it costs a few microseconds a region when the machine is quiet. A value the operator
set stays.
"""

from __future__ import annotations

import os
import sys


def prefer_passive_openmp() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless set already; True when it takes effect (torch
    not loaded yet in this process). Processes this one starts inherit it."""
    if "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "torch" not in sys.modules
