"""The Helm chart's objects: workloads, probes, GPUs, autoscaling, Secret and ConfigMap,
ServiceMonitor. Each test runs with every renderer this machine has (the Go-template
subset always; Helm where installed, whose output must then equal the subset's)."""

from __future__ import annotations

import re

import pytest

from tests.deploy.chart import (
    CHART_DIR,
    INSTALL_VALUES,
    NAMESPACE,
    Rendered,
    RenderError,
    available_renderers,
    merge_values,
    render_with_subset,
)
from tests.deploy.settings_rules import CREDENTIAL_URLS, secret_settings

RENDERERS = available_renderers()
FULLNAME = "demo-loramux"
COMPONENT = "app.kubernetes.io/component"

each_renderer = pytest.mark.parametrize("renderer", list(RENDERERS))


def render(renderer: str, overrides: dict | None = None) -> Rendered:
    values = merge_values(INSTALL_VALUES, overrides or {})
    rendered = RENDERERS[renderer](CHART_DIR, values)
    if renderer != "subset":
        # Where Helm is installed, the renderer CI relies on must agree with it.
        subset = render_with_subset(CHART_DIR, values)
        assert rendered.documents == subset.documents
        assert not rendered.notes or rendered.notes == subset.notes
    return rendered


def objects(rendered: Rendered, kind: str) -> list[dict]:
    return [doc for doc in rendered.documents if doc["kind"] == kind]


def one(rendered: Rendered, kind: str, component: str | None = None) -> dict:
    found = [
        doc
        for doc in objects(rendered, kind)
        if component is None or doc["metadata"]["labels"].get(COMPONENT) == component
    ]
    assert len(found) == 1, f"{len(found)} {kind} objects for {component}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    (only,) = pod_spec(workload)["containers"]
    return only


def env(workload: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container(workload).get("env") or []}


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


@each_renderer
def test_renders_every_workload_and_object(renderer):
    rendered = render(renderer)
    kinds = sorted(
        (doc["kind"], doc["metadata"]["labels"].get(COMPONENT, "")) for doc in rendered.documents
    )
    assert kinds == [
        ("ConfigMap", ""),
        ("Deployment", "beat"),
        ("Deployment", "platform"),
        ("Deployment", "worker"),
        ("HorizontalPodAutoscaler", "platform"),
        ("Secret", ""),
        ("Service", "engine"),
        ("Service", "platform"),
        ("ServiceMonitor", ""),
        ("StatefulSet", "engine"),
    ]
    for doc in rendered.documents:
        assert doc["apiVersion"] and doc["metadata"]["name"].startswith(FULLNAME)


@each_renderer
@pytest.mark.parametrize(
    ("component", "port_setting"),
    [("platform", "LORAMUX_PORT"), ("engine", "LORAMUX_ENGINE_SERVER_PORT")],
)
def test_probes_check_healthz_and_readyz_on_the_serving_port(renderer, component, port_setting):
    workload = one(
        render(renderer), "StatefulSet" if component == "engine" else "Deployment", component
    )
    serving = container(workload)
    (port,) = serving["ports"]
    assert port["name"] == "http"
    assert str(port["containerPort"]) == env(workload)[port_setting]["value"]
    for probe, path in (
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
        ("startupProbe", "/healthz"),
    ):
        assert serving[probe]["httpGet"] == {"path": path, "port": "http"}, probe


@each_renderer
def test_services_select_their_pods_by_the_http_port(renderer):
    rendered = render(renderer)
    for component, kind in (("platform", "Deployment"), ("engine", "StatefulSet")):
        workload, service = one(rendered, kind, component), one(rendered, "Service", component)
        assert labels_match(
            service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"]
        )
        assert labels_match(
            workload["spec"]["selector"]["matchLabels"],
            workload["spec"]["template"]["metadata"]["labels"],
        )
        (port,) = service["spec"]["ports"]
        assert port["name"] == "http" and port["targetPort"] == "http"
    engines = one(rendered, "Service", "engine")
    assert engines["spec"]["clusterIP"] == "None"  # headless: one DNS name per engine pod
    assert (
        one(rendered, "StatefulSet", "engine")["spec"]["serviceName"] == engines["metadata"]["name"]
    )


@each_renderer
def test_each_engine_has_one_gpu_and_advertises_its_stable_dns_name(renderer):
    rendered = render(renderer, {"engine": {"replicaCount": 4, "port": 8200}})
    engines = one(rendered, "StatefulSet", "engine")
    assert engines["spec"]["replicas"] == 4
    assert container(engines)["resources"]["limits"]["nvidia.com/gpu"] == 1
    names = [item["name"] for item in container(engines)["env"]]
    variables = env(engines)
    assert variables["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    service = one(rendered, "Service", "engine")["metadata"]["name"]
    assert variables["LORAMUX_ENGINE_SERVER_ADVERTISE_URL"]["value"] == (
        f"http://$(POD_NAME).{service}.{NAMESPACE}.svc.cluster.local:8200"
    )
    assert variables["LORAMUX_ENGINE_SERVER_PORT"]["value"] == "8200"
    assert variables["LORAMUX_ENGINE_SERVER_ID"]["value"] == "$(POD_NAME)"
    # Kubernetes expands $(POD_NAME) only from variables defined before it.
    assert names.index("POD_NAME") < names.index("LORAMUX_ENGINE_SERVER_ADVERTISE_URL")
    assert names.index("POD_NAME") < names.index("LORAMUX_ENGINE_SERVER_ID")


@each_renderer
def test_a_tensor_parallel_engine_pod_gets_its_gpus_and_shared_memory(renderer):
    one_gpu = one(render(renderer), "StatefulSet", "engine")
    assert "dshm" not in [m["name"] for m in container(one_gpu)["volumeMounts"]]
    rendered = render(renderer, {"engine": {"tensorParallelSize": 4}})
    engines = one(rendered, "StatefulSet", "engine")
    assert container(engines)["resources"]["limits"]["nvidia.com/gpu"] == 4
    mounts = {m["name"]: m["mountPath"] for m in container(engines)["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    volumes = {v["name"]: v for v in engines["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    config = one(rendered, "ConfigMap")["data"]
    assert config["LORAMUX_ENGINE_TENSOR_PARALLEL_SIZE"] == "4"


@each_renderer
def test_the_hpa_scales_the_platform_deployment(renderer):
    rendered = render(
        renderer, {"platform": {"autoscaling": {"minReplicas": 3, "maxReplicas": 12}}}
    )
    hpa, platform = (
        one(rendered, "HorizontalPodAutoscaler"),
        one(rendered, "Deployment", "platform"),
    )
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": platform["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    assert "replicas" not in platform["spec"]  # the HPA owns the count
    assert "cpu" in container(platform)["resources"]["requests"]  # utilization needs one


@each_renderer
def test_without_autoscaling_the_platform_has_fixed_replicas(renderer):
    rendered = render(
        renderer, {"platform": {"autoscaling": {"enabled": False}, "replicaCount": 3}}
    )
    assert objects(rendered, "HorizontalPodAutoscaler") == []
    assert one(rendered, "Deployment", "platform")["spec"]["replicas"] == 3


@each_renderer
def test_beat_is_always_one_pod_and_workers_scale(renderer):
    rendered = render(renderer, {"worker": {"replicaCount": 5, "concurrency": 3}})
    beat, worker = one(rendered, "Deployment", "beat"), one(rendered, "Deployment", "worker")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}  # never two beats at once
    assert worker["spec"]["replicas"] == 5
    assert "--concurrency=3" in container(worker)["command"]


@each_renderer
def test_secrets_live_in_the_secret_and_settings_in_the_configmap(renderer):
    rendered = render(renderer)
    secret = one(rendered, "Secret")["stringData"]
    config = one(rendered, "ConfigMap")["data"]
    assert secret_settings() | CREDENTIAL_URLS <= set(secret)
    assert not (secret_settings() | CREDENTIAL_URLS) & set(config)
    # Kubernetes takes only strings as ConfigMap data and env values.
    assert all(isinstance(value, str) for value in [*config.values(), *secret.values()])
    for workload in [*objects(rendered, "Deployment"), *objects(rendered, "StatefulSet")]:
        for name, item in env(workload).items():
            assert "value" not in item or isinstance(item["value"], str), name
            assert name not in secret or "secretKeyRef" in item.get("valueFrom", {}), name


@each_renderer
def test_an_existing_secret_replaces_the_charts(renderer):
    rendered = render(renderer, {"secrets": {"existingSecret": "mine", "databaseUrl": None}})
    assert objects(rendered, "Secret") == []
    for workload in [*objects(rendered, "Deployment"), *objects(rendered, "StatefulSet")]:
        refs = [
            item["valueFrom"]["secretKeyRef"]
            for item in env(workload).values()
            if "secretKeyRef" in item.get("valueFrom", {})
        ]
        assert refs and {ref["name"] for ref in refs} == {"mine"}


@each_renderer
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"secrets": {"databaseUrl": ""}}, "secrets.databaseUrl is required"),
        ({"secrets": {"redisUrl": ""}}, "secrets.redisUrl is required"),
        ({"secrets": {"engineSecret": ""}}, "secrets.engineSecret is required"),
        ({"secrets": {"adminToken": ""}}, "secrets.adminToken is required"),
        ({"store": {"bucket": ""}}, "store.bucket is required"),
    ],
)
def test_a_missing_required_value_stops_the_render(renderer, value, message):
    with pytest.raises(RenderError, match=re.escape(message)):
        render(renderer, value)


@each_renderer
def test_the_service_monitor_scrapes_platform_and_engines(renderer):
    rendered = render(renderer, {"serviceMonitor": {"labels": {"release": "prometheus"}}})
    monitor = one(rendered, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    selector = monitor["spec"]["selector"]
    selected = [
        service["metadata"]["labels"][COMPONENT]
        for service in objects(rendered, "Service")
        if labels_match(selector["matchLabels"], service["metadata"]["labels"])
        and all(
            service["metadata"]["labels"].get(rule["key"]) in rule["values"]
            for rule in selector.get("matchExpressions", [])
        )
    ]
    assert sorted(selected) == ["engine", "platform"]
    assert objects(render(renderer, {"serviceMonitor": {"enabled": False}}), "ServiceMonitor") == []


@each_renderer
def test_a_settings_change_rolls_every_pod(renderer):
    def checksums(rendered: Rendered) -> list[str]:
        workloads = [*objects(rendered, "Deployment"), *objects(rendered, "StatefulSet")]
        assert len(workloads) == 4
        return [
            w["spec"]["template"]["metadata"]["annotations"]["checksum/config"] for w in workloads
        ]

    before = checksums(render(renderer))
    after = checksums(render(renderer, {"engine": {"kvCacheBytes": 1 << 30}}))
    assert len(set(before)) == 1 and len(set(after)) == 1 and before != after


@each_renderer
def test_the_model_volume_is_mounted_read_only_where_the_model_is_read(renderer):
    claim = {"persistentVolumeClaim": {"claimName": "models"}}
    rendered = render(renderer, {"model": {"volume": claim, "path": "/models/llama-3-8b"}})
    for kind, component in (("Deployment", "platform"), ("StatefulSet", "engine")):
        workload = one(rendered, kind, component)
        volumes = {volume["name"]: volume for volume in pod_spec(workload)["volumes"]}
        assert volumes["model"] == {"name": "model", **claim}
        mounts = {mount["name"]: mount for mount in container(workload)["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert one(rendered, "ConfigMap")["data"]["LORAMUX_MODEL"] == "/models/llama-3-8b"
    plain = render(renderer)
    assert "model" not in {v["name"] for v in pod_spec(one(plain, "StatefulSet"))["volumes"]}


@each_renderer
def test_engine_persistence_claims_a_volume_per_engine(renderer):
    engines = one(
        render(renderer, {"engine": {"persistence": {"enabled": True, "size": "80Gi"}}}),
        "StatefulSet",
    )
    (claim,) = engines["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "80Gi"
    assert "volumes" not in pod_spec(engines)  # no emptyDir shadows the claim


def test_notes_say_how_to_reach_the_platform():
    notes = render("subset").notes
    assert f"svc/{FULLNAME}-platform" in notes and "LORAMUX_ADMIN_TOKEN" in notes


# Keys whose value is a Kubernetes object passed through as it is: documented as a whole.
PASSTHROUGH = {
    "resources",
    "tolerations",
    "affinity",
    "nodeSelector",
    "podAnnotations",
    "annotations",
    "labels",
    "volume",
    "imagePullSecrets",
}


def undocumented_values(text: str) -> list[str]:
    """Keys of values.yaml with a value but no comment (on the line, or right above it)."""
    missing, stack, previous = [], [], ""
    for line in text.splitlines():
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):(.*)$", line)
        if match:
            indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
            stack = [(i, k) for i, k in stack if i < indent]
            path = [k for _, k in stack] + [key]
            value = rest.split(" #")[0].strip()
            documented = "#" in rest or previous.lstrip().startswith("#")
            if value and not documented and not PASSTHROUGH & set(path[:-1]):
                missing.append(".".join(path))
            stack.append((indent, key))
        if line.strip():
            previous = line
    return missing


def test_every_value_is_documented():
    text = (CHART_DIR / "values.yaml").read_text()
    assert undocumented_values(text) == []
    broken = text.replace("  # Service type of the platform.\n", "")
    assert undocumented_values(broken) == ["platform.service.type"]
