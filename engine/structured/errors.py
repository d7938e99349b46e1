"""The one error of structured outputs."""

from __future__ import annotations


class GrammarError(ValueError):
    """A structured-output request the engine cannot serve: a malformed spec, or a schema,
    pattern or tool list that does not compile. The message names the problem; the API
    turns it into HTTP 400 (it is a ValueError, as a bad SamplingParams field is)."""
