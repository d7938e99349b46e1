"""deploy/compose.yaml, parsed and interpolated with a deploy/.env made from the example:
the services, GPUs, wiring of the shared state, health checks and start order."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.processes import (
    COMPOSE_FILE,
    DEPLOY_DIR,
    REPO_ROOT,
    env_file_values,
    interpolate,
    role_of,
)

LORAMUX_SERVICES = {"platform", "engine", "worker", "beat"}


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    return interpolate(raw["services"], env_file_values())


def by_role(services: dict, role: str) -> dict[str, dict]:
    return {name: s for name, s in services.items() if role_of(s.get("command") or []) == role}


def test_every_part_of_the_topology_is_a_service(services):
    assert {"postgres", "redis", "minio", "minio-init"} | LORAMUX_SERVICES <= set(services)
    assert list(by_role(services, "platform")) == ["platform"]
    assert list(by_role(services, "worker")) == ["worker"]
    assert list(by_role(services, "beat")) == ["beat"]  # two beats would send tasks twice
    assert len(by_role(services, "engine")) >= 2  # one per GPU; the second behind a profile


def test_each_engine_reserves_its_own_gpu(services):
    engines = by_role(services, "engine")
    gpus = []
    for name, engine in engines.items():
        (device,) = engine["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        # One GPU per tensor-parallel rank: as many as the engine's setting says.
        ranks = int(engine["environment"].get("LORAMUX_ENGINE_TENSOR_PARALLEL_SIZE", "1"))
        assert len(device["device_ids"]) == ranks, name
        if ranks > 1:  # NCCL's shared memory: more than Docker's 64 MiB
            assert engine["shm_size"].endswith("gb"), name
        gpus += device["device_ids"]
    assert len(set(gpus)) == len(gpus)
    # A plain `up` starts one engine; the others need their profile (and their GPU).
    assert [name for name, engine in engines.items() if not engine.get("profiles")] == ["engine"]


def test_each_engine_advertises_its_own_service_name_and_keeps_its_own_data(services):
    engines = by_role(services, "engine")
    for name, engine in engines.items():
        env = engine["environment"]
        url = urlsplit(env["LORAMUX_ENGINE_SERVER_ADVERTISE_URL"])
        assert (url.hostname, str(url.port)) == (name, env["LORAMUX_ENGINE_SERVER_PORT"]), name
        assert env["LORAMUX_ENGINE_SERVER_ID"] == name
    data = [next(v for v in e["volumes"] if v.endswith(":/data")) for e in engines.values()]
    assert len(set(data)) == len(data)


def test_shared_state_points_at_the_compose_services(services):
    postgres = services["postgres"]["environment"]
    minio = services["minio"]["environment"]
    for name in LORAMUX_SERVICES:
        env = services[name]["environment"]
        redis = urlsplit(env["LORAMUX_REDIS_URL"])
        assert (redis.scheme, redis.hostname, redis.port) == ("redis", "redis", 6379), name
        s3 = urlsplit(env["LORAMUX_S3_ENDPOINT_URL"])
        assert (s3.hostname, s3.port) == ("minio", 9000), name
        assert env["LORAMUX_S3_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"], name
        assert env["LORAMUX_S3_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"], name
        if "LORAMUX_DATABASE_URL" in env:
            db = urlsplit(env["LORAMUX_DATABASE_URL"])
            assert (db.hostname, db.port, db.path) == (
                "postgres",
                5432,
                "/" + postgres["POSTGRES_DB"],
            )
            assert (db.username, db.password) == (
                postgres["POSTGRES_USER"],
                postgres["POSTGRES_PASSWORD"],
            )
    # The one-shot job creates the bucket loramux uses, on the same MinIO, as the same user.
    init = services["minio-init"]["environment"]
    assert init["BUCKET"] == services["platform"]["environment"]["LORAMUX_S3_BUCKET"]
    store = urlsplit(init["MC_HOST_store"])
    assert (store.hostname, store.port) == ("minio", 9000)
    assert (store.username, store.password) == (
        minio["MINIO_ROOT_USER"],
        minio["MINIO_ROOT_PASSWORD"],
    )
    assert "$BUCKET" in " ".join(services["minio-init"]["entrypoint"])


def test_the_celery_broker_is_shared_by_platform_worker_and_beat(services):
    brokers = {
        services[name]["environment"]["LORAMUX_CELERY_BROKER_URL"]
        for name in ("platform", "worker", "beat")
    }
    (broker,) = brokers
    assert urlsplit(broker).hostname == "redis"


def test_health_checks_hit_the_serving_ports(services):
    for name in ("postgres", "redis", "minio", "worker", *by_role(services, "engine"), "platform"):
        assert services[name]["healthcheck"]["test"], name
    platform = services["platform"]
    # Serving (so migrated) is what the worker and beat wait for; readiness needs an engine.
    assert f"127.0.0.1:{platform['environment']['LORAMUX_PORT']}/healthz" in " ".join(
        platform["healthcheck"]["test"]
    )
    for name, engine in by_role(services, "engine").items():
        port = engine["environment"]["LORAMUX_ENGINE_SERVER_PORT"]
        assert f"127.0.0.1:{port}/readyz" in " ".join(engine["healthcheck"]["test"]), name
    assert platform["ports"] == [f"8000:{platform['environment']['LORAMUX_PORT']}"]


def test_services_start_after_what_they_need(services):
    def waits_for(name: str) -> dict[str, str]:
        return {dep: rule["condition"] for dep, rule in services[name]["depends_on"].items()}

    assert waits_for("platform") == {
        "postgres": "service_healthy",
        "redis": "service_healthy",
        "minio-init": "service_completed_successfully",
    }
    for name in by_role(services, "engine"):
        assert waits_for(name) == {
            "redis": "service_healthy",
            "minio-init": "service_completed_successfully",
        }
    # The platform migrates the database as it starts: tasks wait for it.
    assert waits_for("worker") == waits_for("beat") == {"platform": "service_healthy"}
    assert waits_for("minio-init") == {"minio": "service_healthy"}


def test_loramux_services_are_built_from_the_dockerfile(services):
    for name in ("platform", "worker", "beat", *by_role(services, "engine")):
        build = services[name]["build"]
        context = (DEPLOY_DIR / build["context"]).resolve()
        assert context == REPO_ROOT, name
        assert Path(context / build["dockerfile"]).is_file(), name
