"""The compose file and the Helm chart pass only real settings, and every setting each
process needs (checked against the settings model); broken copies of both are caught."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import (
    CHART_DIR,
    INSTALL_VALUES,
    available_renderers,
    merge_values,
    render_with_subset,
)
from tests.deploy.processes import (
    COMPOSE_FILE,
    DOCKERFILE,
    ENV_EXAMPLE,
    chart_processes,
    compose_processes,
    compose_variables,
    env_file_values,
    read_env_file,
)
from tests.deploy.settings_rules import configmap_problems, known_settings, problems


def compose_problems(text: str) -> list[str]:
    return problems(compose_processes(yaml.safe_load(text), env_file_values()))


def chart_problems(chart_dir: Path, values: dict, renderer=render_with_subset) -> list[str]:
    documents = renderer(chart_dir, values).documents
    return problems(chart_processes(documents)) + configmap_problems(documents)


def broken_chart(tmp_path: Path, template: str, old: str, new: str) -> Path:
    """A copy of the chart with one edit in one template (which must apply exactly once)."""
    copy = tmp_path / "loramux"
    shutil.copytree(CHART_DIR, copy)
    path = copy / "templates" / template
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not in {template} exactly once"
    path.write_text(text.replace(old, new))
    return copy


def broken_compose(old: str, new: str, count: int = 1) -> str:
    text = COMPOSE_FILE.read_text()
    assert text.count(old) == count, f"{old!r} is not in compose.yaml {count} time(s)"
    return text.replace(old, new)


# --- the files as they are -------------------------------------------------------------------


def test_compose_passes_known_and_required_settings():
    assert compose_problems(COMPOSE_FILE.read_text()) == []


@pytest.mark.parametrize("renderer", available_renderers().values(), ids=available_renderers())
def test_chart_passes_known_and_required_settings(renderer):
    assert chart_problems(CHART_DIR, INSTALL_VALUES, renderer) == []


def test_the_chart_can_set_every_setting():
    # Optional values left unset in values.yaml are set here: then every field is passed.
    optional = {
        "adapterDeviceBytes": 1 << 30,
        "dtype": "bfloat16",
        "maxPrefillChunk": 512,
        "prefillStepTargetSeconds": 0.05,
        "computeThreads": 8,
        "grammarCacheTenantBytes": 1 << 26,
        "maxModelLen": 4096,
        "maxAdaptersPerStep": 32,
        "draftModel": "/models/draft",
        "draftKvCacheBytes": 1 << 26,
        "kernels": "torch",
    }
    values = merge_values(INSTALL_VALUES, {"engine": optional})
    passed = set()
    for process in chart_processes(render_with_subset(CHART_DIR, values).documents):
        passed |= set(process.env)
    assert sorted(known_settings() - passed) == [], "settings the chart cannot set"


def test_chart_with_an_existing_secret_passes_required_settings():
    values = {
        "secrets": {"existingSecret": "loramux-secrets"},
        "store": {"bucket": "loramux", "endpointUrl": "http://minio:9000"},
    }
    assert chart_problems(CHART_DIR, values) == []


def test_dockerfile_sets_only_settings():
    names = re.findall(r"\b(LORAMUX_[A-Z0-9_]+)=", DOCKERFILE.read_text())
    assert names, "the Dockerfile sets no LORAMUX_ variable"
    assert sorted(set(names) - known_settings()) == []


def test_env_example_documents_every_compose_variable():
    example = ENV_EXAMPLE.read_text()
    documented = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=", example, re.M))
    required_keys = set(read_env_file(ENV_EXAMPLE))
    variables = compose_variables(COMPOSE_FILE.read_text())
    assert sorted(set(variables) - documented) == []
    # compose refuses to start without these: the example must list them uncommented.
    required = {name for name, op in variables.items() if op.endswith("?")}
    assert sorted(required - required_keys) == []


def test_compose_refuses_to_start_without_a_secret():
    values = env_file_values()
    del values["ENGINE_SECRET"]
    found = problems(compose_processes(yaml.safe_load(COMPOSE_FILE.read_text()), values))
    assert any("ENGINE_SECRET: set ENGINE_SECRET in deploy/.env" in line for line in found)


# --- broken copies are caught ----------------------------------------------------------------


def test_a_misspelled_setting_in_the_chart_is_reported(tmp_path):
    chart = broken_chart(
        tmp_path, "configmap.yaml", "LORAMUX_ENGINE_KV_CACHE_BYTES:", "LORAMUX_KV_CACHE_BYTE:"
    )
    found = chart_problems(chart, INSTALL_VALUES)
    assert any("LORAMUX_KV_CACHE_BYTE is not a setting" in line for line in found), found


def test_a_setting_missing_from_the_chart_is_reported(tmp_path):
    chart = broken_chart(
        tmp_path,
        "engine-statefulset.yaml",
        '"LORAMUX_REDIS_URL" "LORAMUX_ENGINE_SERVER_SECRET"',
        '"LORAMUX_REDIS_URL"',
    )
    found = chart_problems(chart, INSTALL_VALUES)
    assert any("the engine needs LORAMUX_ENGINE_SERVER_SECRET" in line for line in found), found


def test_a_secret_in_the_chart_configmap_is_reported(tmp_path):
    chart = broken_chart(
        tmp_path,
        "configmap.yaml",
        "  LORAMUX_DATA_DIR: /data\n",
        "  LORAMUX_DATA_DIR: /data\n  LORAMUX_ENGINE_SERVER_SECRET: {{ .Values.secrets.engineSecret | quote }}\n",
    )
    found = chart_problems(chart, INSTALL_VALUES)
    assert any("holds the secret LORAMUX_ENGINE_SERVER_SECRET" in line for line in found), found


def test_a_chart_reading_a_key_its_secret_lacks_is_reported(tmp_path):
    chart = broken_chart(
        tmp_path, "secret.yaml", "  LORAMUX_ADMIN_TOKEN:", "  LORAMUX_ADMIN_TOKENS:"
    )
    found = chart_problems(chart, INSTALL_VALUES)
    assert any("reads key LORAMUX_ADMIN_TOKEN that Secret" in line for line in found), found


def test_a_misspelled_setting_in_compose_is_reported():
    found = compose_problems(broken_compose("LORAMUX_S3_BUCKET:", "LORAMUX_S3_BUKET:"))
    assert any("LORAMUX_S3_BUKET is not a setting" in line for line in found), found
    assert any("the platform needs LORAMUX_S3_BUCKET" in line for line in found), found


def test_a_setting_missing_from_compose_is_reported():
    found = compose_problems(broken_compose("      LORAMUX_ENGINE_MODE: remote\n", ""))
    assert any("the platform needs LORAMUX_ENGINE_MODE" in line for line in found), found


def test_a_secret_written_into_compose_is_reported():
    found = compose_problems(
        broken_compose(
            "LORAMUX_ENGINE_SERVER_SECRET: ${ENGINE_SECRET:?set ENGINE_SECRET in deploy/.env}",
            "LORAMUX_ENGINE_SERVER_SECRET: hunter2",
        )
    )
    assert any(
        "LORAMUX_ENGINE_SERVER_SECRET must come from a Secret / deploy/.env" in line
        for line in found
    ), found


def test_an_invalid_setting_value_in_compose_is_reported():
    found = compose_problems(
        broken_compose("LORAMUX_STORE_BACKEND: s3", "LORAMUX_STORE_BACKEND: s4")
    )
    assert any(
        "the settings model rejects its environment: store_backend" in line for line in found
    )


def test_engines_on_another_model_than_the_platform_are_reported():
    found = compose_problems(
        broken_compose(
            "      LORAMUX_ENGINE_SERVER_ID: engine-2\n",
            "      LORAMUX_ENGINE_SERVER_ID: engine-2\n      LORAMUX_MODEL_ID: another-model\n",
        )
    )
    assert any("LORAMUX_MODEL_ID differs between processes" in line for line in found), found


# --- the commands the files run exist ----------------------------------------------------------


def test_every_command_the_files_run_exists():
    from loramux.platform.cli import build_parser

    processes = compose_processes(yaml.safe_load(COMPOSE_FILE.read_text()), env_file_values())
    processes += chart_processes(render_with_subset(CHART_DIR, INSTALL_VALUES).documents)
    for process in processes:
        if process.role in ("platform", "engine"):
            try:
                build_parser().parse_args(process.command[1:])  # `loramux <command>`
            except SystemExit:
                pytest.fail(f"{process.where}: `{' '.join(process.command)}` is not a command")
        else:
            assert importlib.util.find_spec(process.command[2]) is not None, process.where
