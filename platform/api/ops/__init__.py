"""What operators' tooling reads: liveness and readiness (``health``: ``/healthz``,
``/health``, ``/readyz``) and Prometheus metrics (``metrics``: ``/metrics``, and the
middleware that counts every request)."""

from loramux.platform.api.ops import health, metrics

ROUTERS = (health.router, metrics.router)
