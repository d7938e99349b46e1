"""The errors the engine raises for a request or call it refuses.

They are types, so that whoever handles them (the platform's API, the engine process's
server and the client that reads its answers back) tells the cases apart by class, never
by the words of the message. Each message says what is wrong, for people.
"""

from __future__ import annotations


class EngineError(ValueError):
    """A request or call the engine refuses; the message says why."""


class UnknownAdapter(EngineError):
    """A request or call names an adapter the engine does not have (never added, or
    removed)."""


class AdapterInUse(EngineError):
    """An adapter cannot be removed: requests (running or waiting) still use it."""
