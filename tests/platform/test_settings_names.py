"""The engine's settings are named by family, and the old names still work, with a warning.

``LORAMUX_ENGINE_<FIELD>`` tunes the engine; ``LORAMUX_ENGINE_SERVER_<NAME>`` is the
``loramux engine`` process; everything else is ``LORAMUX_<FIELD>``."""

from __future__ import annotations

import os
import warnings

import pytest

from loramux.platform.engine_settings import FROM_SETTINGS, SET_BY_THE_PLATFORM
from loramux.platform.settings import Settings, setting_fields
from loramux.platform.settings_names import (
    ENGINE_SERVER_FIELDS,
    ENGINE_TUNING_FIELDS,
    DeprecatedSetting,
    env_name,
)


@pytest.fixture
def clean_env(monkeypatch):
    """No LORAMUX_ variable of the caller's (the suite sets one) leaks into the case."""
    for name in [n for n in os.environ if n.startswith("LORAMUX_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def _settings(tmp_path, **kwargs) -> tuple[Settings, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = Settings(data_dir=tmp_path, **kwargs)
    return settings, [str(w.message) for w in caught if w.category is DeprecatedSetting]


def test_the_families_cover_what_the_engine_reads():
    # Every setting the engine config is made of tunes the engine, except the rank limit
    # (uploads share it: LORAMUX_MAX_ADAPTER_RANK); the disk tier's size, the draft model
    # and the compute threads are set through it.
    tuning = (set(FROM_SETTINGS.values()) - {"max_adapter_rank"}) | {
        "adapter_disk_cache_bytes",
        "draft_model",
        "compute_threads",
    }
    assert set(ENGINE_TUNING_FIELDS) == tuning
    assert (
        "LORAMUX_ENGINE_ADAPTER_DISK_CACHE_BYTES" in SET_BY_THE_PLATFORM["adapter_disk_cache_bytes"]
    )
    assert "LORAMUX_ENGINE_DRAFT_MODEL" in SET_BY_THE_PLATFORM["draft_model"]
    fields = set(setting_fields())
    assert set(ENGINE_SERVER_FIELDS) <= fields and set(ENGINE_TUNING_FIELDS) <= fields
    names = [env_name(field) for field in fields]
    assert len(set(names)) == len(names)  # no two settings share a name


def test_new_names_set_the_engine_and_its_server(tmp_path, clean_env):
    clean_env.setenv("LORAMUX_ENGINE_MAX_NUM_SEQS", "7")
    clean_env.setenv("LORAMUX_ENGINE_KV_CACHE_BYTES", str(64 << 20))
    clean_env.setenv("LORAMUX_ENGINE_SERVER_ID", "engine-7")
    clean_env.setenv("LORAMUX_ENGINE_SERVER_PORT", "9100")
    settings, deprecated = _settings(tmp_path)
    engine = settings.engine
    assert (engine.scheduler.max_num_seqs, engine.cache.kv_cache_bytes) == (7, 64 << 20)
    assert (settings.engine_id, settings.engine_port) == ("engine-7", 9100)
    assert deprecated == []


def test_old_names_still_work_and_say_what_replaces_them(tmp_path, clean_env):
    clean_env.setenv("LORAMUX_MAX_NUM_SEQS", "5")
    clean_env.setenv("LORAMUX_ENGINE_ID", "old-engine")
    settings, deprecated = _settings(tmp_path)
    assert settings.engine.scheduler.max_num_seqs == 5 and settings.engine_id == "old-engine"
    assert sorted(deprecated) == [
        "LORAMUX_ENGINE_ID is deprecated: set LORAMUX_ENGINE_SERVER_ID instead",
        "LORAMUX_MAX_NUM_SEQS is deprecated: set LORAMUX_ENGINE_MAX_NUM_SEQS instead",
    ]


def test_a_new_name_wins_over_an_old_one(tmp_path, clean_env):
    clean_env.setenv("LORAMUX_MAX_NUM_SEQS", "5")
    clean_env.setenv("LORAMUX_ENGINE_MAX_NUM_SEQS", "9")
    settings, deprecated = _settings(tmp_path)
    assert settings.engine.scheduler.max_num_seqs == 9
    assert deprecated == [
        "LORAMUX_MAX_NUM_SEQS is deprecated: set LORAMUX_ENGINE_MAX_NUM_SEQS instead "
        "(ignored: it is set too)"
    ]


def test_arguments_win_over_the_environment(tmp_path, clean_env):
    clean_env.setenv("LORAMUX_ENGINE_MAX_NUM_SEQS", "9")
    settings, _ = _settings(tmp_path, max_num_seqs=3)
    assert settings.engine.scheduler.max_num_seqs == 3


def test_a_bad_value_under_a_new_name_names_the_field(tmp_path, clean_env):
    clean_env.setenv("LORAMUX_ENGINE_MAX_NUM_SEQS", "many")
    with pytest.raises(ValueError, match="max_num_seqs"):
        Settings(data_dir=tmp_path)
