"""Render the loramux Helm chart: with the Go-template subset in ``gotemplate`` (always
available), or with real Helm where it is installed (the ``helm`` binary, or the
``helm_python`` SDK that embeds Helm's Go library).

Each renderer takes values overrides and returns a :class:`Rendered`: the Kubernetes
documents of every template, and NOTES.txt.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.gotemplate import TemplateError, TemplateSet

CHART_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "loramux"
RELEASE = "demo"
NAMESPACE = "serving"


# What an operator sets to install the chart (see docs/operations.md): the
# tests render it with these values on top of values.yaml.
INSTALL_VALUES = {
    "secrets": {
        "databaseUrl": "postgresql+psycopg://loramux:pw@postgres:5432/loramux",
        "redisUrl": "redis://:pw@redis:6379/0",
        "celeryBrokerUrl": "redis://:pw@redis:6379/1",
        "engineSecret": "engine-secret",
        "adminToken": "admin-token",
        "s3AccessKeyId": "access-key",
        "s3SecretAccessKey": "secret-key",
    },
    "store": {"bucket": "loramux", "endpointUrl": "http://minio:9000"},
    "serviceMonitor": {"enabled": True},
}


class RenderError(Exception):
    """The chart does not render with these values (a `required` value is missing...)."""


@dataclass
class Rendered:
    texts: dict[str, str]  # template path (loramux/templates/...) -> rendered text

    @property
    def documents(self) -> list[dict]:
        """Every non-empty YAML document, in template-path order (NOTES.txt aside)."""
        documents = []
        for path, text in sorted(self.texts.items()):
            if not path.endswith("NOTES.txt"):
                documents += [doc for doc in yaml.safe_load_all(text) if doc is not None]
        return documents

    @property
    def notes(self) -> str:
        return next((text for path, text in self.texts.items() if path.endswith("NOTES.txt")), "")


Renderer = Callable[[Path, dict], Rendered]


def merge_values(base: dict, overrides: dict) -> dict:
    """Helm's merge of user values over a chart's: maps merge key by key, anything else
    replaces, and ``None`` removes the key."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def as_helm_numbers(value: Any) -> Any:
    """Values as Helm holds them after reading YAML: every number a float64."""
    if isinstance(value, dict):
        return {key: as_helm_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_helm_numbers(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _is_partial(path: str) -> bool:
    """Helm renders no output for templates/_*: they hold only `define`s."""
    return path.rsplit("/", 1)[-1].startswith("_")


def render_with_subset(chart_dir: Path, overrides: dict) -> Rendered:
    """Render with :mod:`tests.deploy.gotemplate`, the way ``helm template`` would."""
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    values = merge_values(yaml.safe_load((chart_dir / "values.yaml").read_text()), overrides)
    base_path = f"{chart['name']}/templates"
    templates = TemplateSet()
    names = []
    for path in sorted((chart_dir / "templates").iterdir()):
        name = f"{base_path}/{path.name}"
        try:
            templates.add(name, path.read_text())
        except TemplateError as exc:
            raise RenderError(f"{name}: {exc}") from exc
        names.append(name)
    data = {
        "Values": as_helm_numbers(values),
        "Release": {
            "Name": RELEASE,
            "Namespace": NAMESPACE,
            "Service": "Helm",
            "IsInstall": True,
            "IsUpgrade": False,
            "Revision": 1,
        },
        "Chart": {
            "Name": chart["name"],
            "Version": chart["version"],
            "AppVersion": chart.get("appVersion", ""),
        },
    }
    texts = {}
    for name in names:
        if _is_partial(name):
            continue
        try:
            texts[name] = templates.render(
                name, {**data, "Template": {"BasePath": base_path, "Name": name}}
            )
        except TemplateError as exc:
            raise RenderError(f"{name}: {exc}") from exc
    return Rendered(texts)


def render_with_helm_binary(chart_dir: Path, overrides: dict) -> Rendered:
    """``helm template`` (which leaves NOTES.txt out)."""
    result = subprocess.run(
        ["helm", "template", RELEASE, str(chart_dir), "--namespace", NAMESPACE, "-f", "-"],
        input=json.dumps(overrides),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RenderError(result.stderr)
    texts: dict[str, str] = {}
    # Each document comes as "---\n# Source: <template path>\n<document>".
    for section in re.split(r"^---\n", result.stdout, flags=re.M):
        header, _, body = section.partition("\n")
        if header.startswith("# Source: "):
            path = header.removeprefix("# Source: ")
            texts[path] = texts[path] + "\n---\n" + body if path in texts else body
    return Rendered(texts)


def render_with_helm_sdk(chart_dir: Path, overrides: dict) -> Rendered:
    """Helm's own engine through the ``helm_python`` SDK (Helm's Go library, no binary)."""
    import helm_python

    with helm_python.Chart.load(str(chart_dir)) as chart:
        try:
            texts = chart.render(overrides, name=RELEASE, namespace=NAMESPACE, is_install=True)
        except helm_python.HelmError as exc:
            raise RenderError(str(exc)) from exc
    return Rendered({path: text for path, text in texts.items() if not _is_partial(path)})


def _helm_sdk_installed() -> bool:
    try:
        import helm_python  # noqa: F401
    except ImportError:
        return False
    return True


def available_renderers() -> dict[str, Renderer]:
    """The subset renderer always; real Helm too where this machine has it."""
    renderers: dict[str, Renderer] = {"subset": render_with_subset}
    if shutil.which("helm"):
        renderers["helm"] = render_with_helm_binary
    if _helm_sdk_installed():
        renderers["helm-sdk"] = render_with_helm_sdk
    return renderers
