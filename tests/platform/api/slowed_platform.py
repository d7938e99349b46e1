"""A platform app whose engine steps are slowed by a fixed sleep, so that over HTTP a
request is reliably queued, prefilling or decoding at a given moment on the tiny model
(deadline and load-shedding tests), and helpers to drive it."""

from __future__ import annotations

import json
import threading
import time
import uuid

STEP_S = 0.02  # each engine step sleeps this long (the tiny model's own step is ~ms)


def slow_steps(context, seconds: float = STEP_S) -> list:
    """Make every engine step take ``seconds`` longer; returns a log of each step's
    scheduled (request id, computed tokens before the step, tokens this step)."""
    runner = context.engine.engine.executor
    execute = runner.execute
    log: list = []

    def slowed(plan):
        log.append(
            [(s.seq.request_id, s.seq.num_computed_tokens, s.num_tokens) for s in plan.scheduled]
        )
        time.sleep(seconds)
        return execute(plan)

    runner.execute = slowed
    runner.step_log = log
    return log


def tenant_headers(client, context, **fields) -> tuple[str, dict[str, str]]:
    """A new tenant (``fields`` as the admin API takes them) and its API key's headers."""
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    name = f"t-{uuid.uuid4().hex[:12]}"
    response = client.post("/admin/tenants", json={"name": name, **fields}, headers=admin)
    assert response.status_code == 201, response.text
    tenant = response.json()
    response = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin)
    assert response.status_code == 201, response.text
    return tenant["id"], {"Authorization": f"Bearer {response.json()['key']}"}


def completion(context, **fields) -> dict:
    return {"model": context.base_model.model_id, "prompt": "Once upon a time", **fields}


def sse_events(response) -> list:
    """A streamed response's events (``[DONE]`` as the string)."""
    events = []
    for block in response.text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def engine_idle(context) -> None:
    """Nothing of any request is left in the engine: no sequence, no KV block."""
    engine = context.engine.engine
    deadline = time.monotonic() + 5
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0


def post_in_background(client, path: str, **kwargs) -> threading.Thread:
    """``client.post(path, **kwargs)`` in a thread the fixture joins before it closes the app
    (a test that fails with requests still running must not leave them to a closed app)."""
    thread = threading.Thread(target=client.post, args=(path,), kwargs=kwargs, daemon=True)
    thread.start()
    client.background.append(thread)
    return thread
