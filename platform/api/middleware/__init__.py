"""ASGI middleware in front of every route: the request-body limits and deadline
(``body_limit``) and the guard on what a request may carry (``input_guard``). The HTTP
metrics' middleware is with the metrics (``ops/metrics.py``)."""
