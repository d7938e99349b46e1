"""The HTTP API, one package per API:

- ``completions``, ``chat``, ``responses``, ``models``: the OpenAI-compatible APIs, over
  what they share in ``openai`` (schemas, field checks, renders, ``respond``);
- ``tenant``: a tenant's adapters, usage and identity;
- ``admin``: the operator's API and the admin UI;
- ``ops``: health, readiness and metrics;
- ``middleware``: body limits and the input guard.

Shared by all: ``deps`` (the FastAPI dependencies: context, session, caller), ``errors``
and ``error_codes`` (the one error shape and its table), ``openapi_errors`` (the errors each
route declares in ``/openapi.json``). Each package's ``ROUTERS`` are what the app factory
(``platform/app.py``) includes.
"""
