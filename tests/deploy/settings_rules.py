"""What the deployment files must pass to each loramux process, checked against the
settings model (``loramux.platform.settings.Settings``).

:func:`problems` returns one line per violation, so a test asserts it is empty and a
broken file names what is wrong.
"""

from __future__ import annotations

import typing
from urllib.parse import urlsplit

from pydantic import SecretStr, ValidationError

from loramux.platform.settings import Settings, setting_fields
from loramux.platform.settings_names import env_name
from tests.deploy.processes import ROLES, Process, SecretRef

PREFIX = "LORAMUX_"


def field_of_env_name() -> dict[str, str]:
    return {env_name(field): field for field in setting_fields()}


def known_settings() -> set[str]:
    return set(field_of_env_name())


def secret_settings() -> set[str]:
    """Settings typed ``SecretStr``: they may only come from a Secret or deploy/.env."""
    return {
        env_name(field)
        for field, info in setting_fields().items()
        if SecretStr in typing.get_args(info.annotation) or info.annotation is SecretStr
    }


# Connection strings may carry passwords: one that does is kept with the secrets although
# the setting is typed `str`.
CREDENTIAL_URLS = {"LORAMUX_DATABASE_URL", "LORAMUX_REDIS_URL", "LORAMUX_CELERY_BROKER_URL"}

_STORE = {
    "LORAMUX_STORE_BACKEND",
    "LORAMUX_S3_BUCKET",
    "LORAMUX_S3_ENDPOINT_URL",
    "LORAMUX_S3_ACCESS_KEY_ID",
    "LORAMUX_S3_SECRET_ACCESS_KEY",
}
_MODEL = {"LORAMUX_MODEL", "LORAMUX_MODEL_ID"}

# What a production deployment must pass to each process (beyond the defaults).
REQUIRED: dict[str, set[str]] = {
    "platform": _STORE
    | _MODEL
    | {
        "LORAMUX_HOST",
        "LORAMUX_PORT",
        "LORAMUX_DATA_DIR",
        "LORAMUX_DATABASE_URL",
        "LORAMUX_REDIS_URL",
        "LORAMUX_CELERY_BROKER_URL",
        "LORAMUX_ENGINE_MODE",
        "LORAMUX_ENGINE_SERVER_SECRET",
        "LORAMUX_ADMIN_TOKEN",
    },
    "engine": _STORE
    | _MODEL
    | {
        "LORAMUX_ENGINE_DEVICE",
        "LORAMUX_DATA_DIR",
        "LORAMUX_REDIS_URL",
        "LORAMUX_ENGINE_SERVER_SECRET",
        "LORAMUX_ENGINE_SERVER_HOST",
        "LORAMUX_ENGINE_SERVER_PORT",
        "LORAMUX_ENGINE_SERVER_ADVERTISE_URL",
        "LORAMUX_ENGINE_SERVER_ID",
    },
    "worker": _STORE | {"LORAMUX_DATABASE_URL", "LORAMUX_REDIS_URL", "LORAMUX_CELERY_BROKER_URL"},
    "beat": _STORE | {"LORAMUX_DATABASE_URL", "LORAMUX_REDIS_URL", "LORAMUX_CELERY_BROKER_URL"},
}

# Values a production deployment must give (the rest only need to be valid).
REQUIRED_VALUES: dict[str, dict[str, str]] = {
    "platform": {
        "LORAMUX_ENGINE_MODE": "remote",
        "LORAMUX_STORE_BACKEND": "s3",
        "LORAMUX_HOST": "0.0.0.0",
    },
    "engine": {"LORAMUX_STORE_BACKEND": "s3", "LORAMUX_ENGINE_SERVER_HOST": "0.0.0.0"},
    "worker": {"LORAMUX_STORE_BACKEND": "s3"},
    "beat": {"LORAMUX_STORE_BACKEND": "s3"},
}

# Settings that must be equal wherever they are passed: the processes share this state.
SHARED = (
    _STORE
    | _MODEL
    | CREDENTIAL_URLS
    | {"LORAMUX_ENGINE_SERVER_SECRET", "LORAMUX_ENGINE_SERVER_HEARTBEAT_S", "LORAMUX_S3_REGION"}
)


def _has_password(url: object) -> bool:
    return isinstance(url, str) and urlsplit(url).password is not None


def _settings_problems(process: Process) -> list[str]:
    """Does the settings model accept this environment, validators included?"""
    fields = {
        # A key of a Secret the chart does not render: any string stands in for it.
        field_of_env_name()[name]: f"<{value.secret}/{value.key}>"
        if isinstance(value, SecretRef)
        else value
        for name, value in process.env.items()
        if name in known_settings()
    }
    try:
        Settings.model_validate(fields)  # only these values: nothing from os.environ
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or 'settings'}: {error['msg']}"
            for error in exc.errors()
        )
        return [f"{process.where}: the settings model rejects its environment: {errors}"]
    return []


def process_problems(process: Process) -> list[str]:
    found = list(process.problems)
    names = set(process.env)
    found += [
        f"{process.where}: {name} is not a setting (no such field in Settings)"
        for name in sorted(n for n in names if n.startswith(PREFIX) and n not in known_settings())
    ]
    found += [
        f"{process.where}: the {process.role} needs {name}"
        for name in sorted(REQUIRED[process.role] - names)
    ]
    for name, expected in REQUIRED_VALUES[process.role].items():
        if name in process.env and process.env[name] != expected:
            found.append(f"{process.where}: {name} is {process.env[name]!r}, not {expected!r}")
    kept_secret = {name for name in names if name in secret_settings()} | {
        name for name in names & CREDENTIAL_URLS if _has_password(process.env[name])
    }
    found += [
        f"{process.where}: {name} must come from a Secret / deploy/.env, not the file itself"
        for name in sorted(kept_secret - process.from_secret)
    ]
    return found + _settings_problems(process)


def problems(processes: list[Process]) -> list[str]:
    """Every violation in one deployment file's processes (empty: all is well)."""
    found = []
    roles = {process.role for process in processes}
    found += [f"no {role} process is deployed" for role in ROLES if role not in roles]
    for process in processes:
        found += process_problems(process)
    for name in sorted(SHARED):
        values = {process.where: process.env[name] for process in processes if name in process.env}
        if len(set(map(repr, values.values()))) > 1:
            found.append(f"{name} differs between processes: {values}")
    return found


def configmap_problems(documents: list[dict]) -> list[str]:
    """Secrets (and connection strings with a password) have no place in a ConfigMap."""
    found = []
    for doc in documents:
        if doc.get("kind") != "ConfigMap":
            continue
        for name, value in (doc.get("data") or {}).items():
            if name in secret_settings() or (name in CREDENTIAL_URLS and _has_password(value)):
                found.append(f"ConfigMap {doc['metadata']['name']} holds the secret {name}")
    return found
