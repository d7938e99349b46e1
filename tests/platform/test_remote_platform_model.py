"""The platform in remote mode never runs the model: from the embedded GGUF it takes only
the config and the tokenizer (issue 15: it converted the whole model, 28 s, on every fresh
data directory)."""

from __future__ import annotations

import time

from loramux.platform.context import build_context
from loramux.platform.settings import Settings


def _remote_settings(data_dir, redis_url) -> Settings:
    """A remote-mode platform on the embedded default model."""
    return Settings(
        data_dir=data_dir,
        engine_mode="remote",
        redis_url=redis_url,
        engine_secret="secret",
        admin_token=None,
    )


def test_remote_mode_reads_only_the_tokenizer_and_config(tmp_path, redis_url):
    settings = _remote_settings(tmp_path, redis_url)
    started = time.monotonic()
    context = build_context(settings, log=lambda _: None)
    took_s = time.monotonic() - started
    print(f"remote-mode platform context on a fresh data dir: {took_s:.1f} s")

    models = tmp_path / "models"
    written = {p.relative_to(models).as_posix() for p in models.rglob("*") if p.is_file()}
    assert not [name for name in written if name.endswith((".safetensors", ".bin"))], written
    folder = context.base_model.path
    assert folder.name == "SmolLM2-135M-Instruct.metadata"
    assert (folder / "config.json").is_file()

    # What the platform does with it: count tokens, render chats, check adapter shapes.
    tokenizer = context.engine.tokenizer
    assert len(tokenizer) == 49152
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in chat
    assert context.engine.max_model_len == 8192
    target = context.validation_target()
    assert target.base_model_id == "SmolLM2-135M-Instruct"

    # A second start reuses it.
    again = build_context(settings, log=lambda _: None)
    assert again.base_model.path == folder
    context.sessions.kw["bind"].dispose()
    again.sessions.kw["bind"].dispose()


def test_a_full_conversion_already_there_is_used(tmp_path, redis_url, smollm2_dir):
    """A data directory that also serves an engine keeps one copy: the converted one."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "SmolLM2-135M-Instruct").symlink_to(smollm2_dir, target_is_directory=True)
    settings = _remote_settings(tmp_path, redis_url)
    context = build_context(settings, log=lambda _: None)
    assert context.base_model.path == models / "SmolLM2-135M-Instruct"
    assert not (models / "SmolLM2-135M-Instruct.metadata").exists()
    context.sessions.kw["bind"].dispose()
