"""Executors: what runs the engine's step batches (``base.Executor``).

``LocalExecutor`` runs them on one device; ``engine/parallel/executor.py`` over the ranks of
a sharded model. The engine picks one where it is built and never asks which it has.
"""

from loramux.engine.executor.base import (
    Devices,
    Executor,
    NonFiniteOutput,
    PromptLogprobs,
    Sampled,
    StepResult,
)
from loramux.engine.executor.local import LocalExecutor, OneDevice

__all__ = [
    "Devices",
    "Executor",
    "LocalExecutor",
    "NonFiniteOutput",
    "OneDevice",
    "PromptLogprobs",
    "Sampled",
    "StepResult",
]
