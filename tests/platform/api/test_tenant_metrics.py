"""``GET /metrics`` carries each tenant's served tokens, queue depth, share and weight."""

from __future__ import annotations

import re

import pytest

MAX_TOKENS = 5


def _tenant_series(text: str, tenant_id: str) -> dict[str, float]:
    """The ``loramux_tenant_*`` samples of one tenant: name (with ``:kind``) -> value."""
    found = {}
    for name, labels, value in re.findall(r"^(loramux_tenant_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if pairs.get("tenant") == tenant_id:
            key = f"{name}:{pairs['kind']}" if "kind" in pairs else name
            found[key] = float(value)
    return found


def test_metrics_show_each_tenants_tokens_queue_share_and_weight(
    client, admin, context, new_tenant
):
    tenants = {}
    for name, weight in (("light", 1.0), ("heavy", 3.0)):
        tenant = new_tenant(name=name, weight=weight)
        key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
        done = client.post(
            "/v1/completions",
            json={
                "model": context.base_model.model_id,
                "prompt": f"Tell {name} a story:",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
            },
            headers={"Authorization": f"Bearer {key}"},
        )
        assert done.status_code == 200, done.text
        tenants[name] = (tenant["id"], done.json()["usage"]["prompt_tokens"], weight)

    text = client.get("/metrics").text
    service = {name: prompt + 2 * MAX_TOKENS for name, (_, prompt, _) in tenants.items()}
    for name, (tenant_id, prompt, weight) in tenants.items():
        series = _tenant_series(text, tenant_id)
        assert series == {
            "loramux_tenant_served_tokens_total:prompt": prompt,
            "loramux_tenant_served_tokens_total:output": MAX_TOKENS,
            "loramux_tenant_served_tokens_created:prompt": series[
                "loramux_tenant_served_tokens_created:prompt"
            ],
            "loramux_tenant_served_tokens_created:output": series[
                "loramux_tenant_served_tokens_created:output"
            ],
            "loramux_tenant_queued_requests": 0.0,
            "loramux_tenant_running_requests": 0.0,
            "loramux_tenant_share": pytest.approx(service[name] / sum(service.values())),
            "loramux_tenant_weight": weight,
            "loramux_tenant_weight_share": 0.0,  # no request now
        }, name
