"""The environment each loramux process gets from the compose file or the rendered chart.

A process is one container running one of the four loramux commands (platform, engine,
worker, beat). Its environment maps every variable to the value the container would see:
compose values after ``${...}`` interpolation, chart values with ConfigMap and Secret
references resolved. A value read from a Secret the chart did not render (an existing
Secret) is a :class:`SecretRef`.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = REPO_ROOT / "deploy"
COMPOSE_FILE = DEPLOY_DIR / "compose.yaml"
ENV_EXAMPLE = DEPLOY_DIR / ".env.example"
DOCKERFILE = DEPLOY_DIR / "Dockerfile"

ROLES = ("platform", "engine", "worker", "beat")
CELERY_APP = "loramux.platform.tasks.worker"


@dataclass(frozen=True)
class SecretRef:
    """A value read from a key of a Secret that is not part of the rendered chart."""

    secret: str
    key: str


@dataclass
class Process:
    role: str  # one of ROLES
    where: str  # e.g. "compose service engine-2" or "chart StatefulSet demo-loramux-engine"
    command: list[str]
    env: dict[str, Any]
    # Variables read from a Secret (the chart) or from deploy/.env (compose).
    from_secret: set[str] = field(default_factory=set)
    # Problems met while resolving the environment (a reference to nothing...).
    problems: list[str] = field(default_factory=list)


def role_of(command: list[str]) -> str | None:
    """Which loramux process a container command starts, if any."""
    words = [str(word) for word in command]
    if words[:2] == ["loramux", "serve"]:
        return "platform"
    if words[:2] == ["loramux", "engine"]:
        return "engine"
    if words[:3] == ["celery", "-A", CELERY_APP] and len(words) > 3:
        return {"worker": "worker", "beat": "beat"}.get(words[3])
    return None


# --- compose -------------------------------------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class InterpolationError(Exception):
    """A required variable (``${VAR:?message}``) is missing."""


def compose_variables(text: str) -> dict[str, str]:
    """Every variable a compose file interpolates, with its operator (``""``, ``:-``, ``:?``...)."""
    found: dict[str, str] = {}
    for match in _VARIABLE.finditer(text):
        name = match.group("braced") or match.group("bare")
        if name:
            found.setdefault(name, match.group("op") or "")
    return found


def interpolate(value: Any, variables: dict[str, str]) -> Any:
    """Compose's interpolation of every string in ``value``, recursively."""
    if isinstance(value, dict):
        return {key: interpolate(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, variables) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group("escaped"):
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op") or "", match.group("arg") or ""
        present = name in variables and (variables[name] != "" or not op.startswith(":"))
        if present:
            return variables[name]
        if op.endswith("?"):
            raise InterpolationError(f"{name}: {arg}")
        return arg if op.endswith("-") else ""

    return _VARIABLE.sub(substitute, value)


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of an env file (comments and blank lines skipped)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def env_file_values() -> dict[str, str]:
    """deploy/.env as a user makes it from the example: every blank secret filled in."""
    return {
        name: value or f"filled-{name.lower().replace('_', '-')}"
        for name, value in read_env_file(ENV_EXAMPLE).items()
    }


def _service_env(service: dict) -> dict[str, Any]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in environment)
    return {key: None if value is None else str(value) for key, value in environment.items()}


def compose_processes(raw: dict, variables: dict[str, str]) -> list[Process]:
    """The loramux processes of a parsed compose file, after interpolation.

    ``raw`` is the file as PyYAML loads it (anchors and merge keys resolved, not
    interpolated): a variable whose raw value interpolates a variable counts as coming
    from deploy/.env, i.e. a secret kept out of the file.
    """
    processes = []
    for name, service in (raw.get("services") or {}).items():
        role = role_of(service.get("command") or [])
        if role is None:
            continue
        raw_env = _service_env(service)
        process = Process(role, f"compose service {name}", service["command"], {})
        try:
            process.env = interpolate(raw_env, variables)
        except InterpolationError as exc:
            process.problems.append(f"{process.where}: {exc}")
        process.from_secret = {
            key for key, value in raw_env.items() if value and _VARIABLE.search(value)
        }
        processes.append(process)
    return processes


def load_compose() -> tuple[dict, str]:
    text = COMPOSE_FILE.read_text()
    return yaml.safe_load(text), text


# --- chart ---------------------------------------------------------------------------------


def _by_kind(documents: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in documents if doc.get("kind") == kind}


def secret_data(secret: dict) -> dict[str, str]:
    data = {
        key: base64.b64decode(value).decode() for key, value in (secret.get("data") or {}).items()
    }
    return {**data, **(secret.get("stringData") or {})}


def _env_from(sources: list[dict], configmaps: dict, secrets: dict, process: Process) -> None:
    for source in sources:
        for kind, objects in (("configMapRef", configmaps), ("secretRef", secrets)):
            if kind not in source:
                continue
            name = source[kind]["name"]
            if name not in objects:
                process.problems.append(f"{process.where}: envFrom {kind} {name} is not rendered")
                continue
            data = objects[name] if kind == "configMapRef" else secret_data(objects[name])
            process.env.update(data)
            if kind == "secretRef":
                process.from_secret |= set(data)


def _env_value(item: dict, configmaps: dict, secrets: dict, process: Process) -> Any:
    source = item.get("valueFrom")
    if source is None:
        return item.get("value", "")
    if "fieldRef" in source:
        return f"<{source['fieldRef']['fieldPath']}>"
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        process.from_secret.add(item["name"])
        if ref["name"] not in secrets:
            return SecretRef(ref["name"], ref["key"])
        data = secret_data(secrets[ref["name"]])
        if ref["key"] not in data and not ref.get("optional"):
            process.problems.append(
                f"{process.where}: {item['name']} reads key {ref['key']} that Secret "
                f"{ref['name']} does not have"
            )
        return data.get(ref["key"])
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return (configmaps.get(ref["name"]) or {}).get(ref["key"])
    process.problems.append(f"{process.where}: unsupported valueFrom in {item['name']}")
    return None


def chart_processes(documents: list[dict]) -> list[Process]:
    """The loramux containers of rendered chart documents, environments resolved."""
    configmaps = {
        name: doc.get("data") or {} for name, doc in _by_kind(documents, "ConfigMap").items()
    }
    secrets = _by_kind(documents, "Secret")
    processes = []
    for doc in documents:
        if doc.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            role = role_of(container.get("command") or [])
            if role is None:
                continue
            where = f"chart {doc['kind']} {doc['metadata']['name']}"
            process = Process(role, where, container["command"], {})
            _env_from(container.get("envFrom") or [], configmaps, secrets, process)
            for item in container.get("env") or []:
                value = _env_value(item, configmaps, secrets, process)
                if value is not None:
                    process.env[item["name"]] = value
            processes.append(process)
    return processes
