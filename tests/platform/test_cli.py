"""The ``loramux`` command: help texts, ``serve`` end to end on the embedded default,
and how the base model setting is resolved."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loramux.platform import cli
from loramux.platform.base_model import BaseModelError, embedded_gguf_path, resolve_base_model
from loramux.platform.engine_settings import engine_config
from loramux.platform.settings import EMBEDDED_MODEL_ID, Settings
from tests.fixtures.engine_budget import budget_env
from tests.fixtures.models import seed_embedded_model

STARTUP_TIMEOUT_S = 60.0


def _loramux_command() -> list[str]:
    """The venv's console script when installed next to this Python, else ``-m``."""
    script = Path(sys.executable).with_name("loramux")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "loramux.platform.cli"]


def _clean_env(**extra: str) -> dict[str, str]:
    # As a fresh shell would start it: no loramux setting, no OpenMP wait policy.
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("LORAMUX_") and key != "OMP_WAIT_POLICY"
    }
    env.update(budget_env(), **extra)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- help ------------------------------------------------------------------------------------


def test_help_lists_serve():
    result = subprocess.run(
        [*_loramux_command(), "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "usage: loramux" in result.stdout
    assert "serve" in result.stdout
    assert "Start the platform" in result.stdout


def test_serve_help_describes_its_options():
    result = subprocess.run(
        [*_loramux_command(), "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "usage: loramux serve" in result.stdout
    assert "Start the platform" in result.stdout
    for option in ("--host", "--port", "--data-dir"):
        assert option in result.stdout


def test_module_entry_point_help():
    result = subprocess.run(
        [sys.executable, "-m", "loramux.platform.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout


def test_no_command_is_an_error():
    result = subprocess.run(_loramux_command(), capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "usage: loramux" in result.stderr
    assert "required" in result.stderr


# --- commands found through entry points (bench) ------------------------------------------


def test_bench_help_is_the_platforms_own():
    result = subprocess.run(
        [*_loramux_command(), "bench", "-h"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "usage: loramux bench" in result.stdout
    assert "Serve a preset workload" in result.stdout


def test_bench_runs_the_command_its_entry_point_names():
    result = subprocess.run(
        [*_loramux_command(), "bench", "cpu-smoke", "-h"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # The benchmarks' own options and presets: their parser answered.
    assert "--sweep" in result.stdout and "cpu-smoke" in result.stdout


def test_a_command_whose_entry_point_is_missing_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(cli, "entry_points", lambda **_: ())
    assert cli.main(["bench", "cpu-smoke"]) == 2
    error = capsys.readouterr().err
    assert "'bench' entry point in group 'loramux.commands'" in error
    assert "make setup" in error and "pip install -e ." in error


# --- serve end to end ------------------------------------------------------------------------


@dataclass
class _Server:
    process: subprocess.Popen
    base_url: str
    log_file: Path

    def output(self) -> str:
        return self.log_file.read_text(errors="replace")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
    assert process.poll() is not None, "loramux serve is still running"


def _wait_healthy(server: _Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(
                f"loramux serve exited with {server.process.returncode} before answering:\n"
                f"{server.output()}",
                pytrace=False,
            )
        try:
            response = httpx.get(f"{server.base_url}/healthz", timeout=2)
            if response.status_code == 200:
                assert response.json() == {"status": "ok"}
                return
        except httpx.HTTPError as exc:
            last_error = exc
        time.sleep(0.2)
    pytest.fail(
        f"loramux serve did not answer /healthz within {STARTUP_TIMEOUT_S:.0f}s "
        f"({last_error}):\n{server.output()}",
        pytrace=False,
    )


@contextlib.contextmanager
def _serving(data_dir: Path, log_file: Path, **settings: str) -> Iterator[_Server]:
    """Run ``loramux serve`` on the embedded default (no LORAMUX_MODEL) or ``settings``
    (environment variables); stop it after."""
    port = _free_port()
    command = [*_loramux_command(), "serve", "--port", str(port), "--data-dir", str(data_dir)]
    env = _clean_env(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **settings)
    with log_file.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=data_dir.parent,
            env=env,
        )
    server = _Server(process, f"http://127.0.0.1:{port}", log_file)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(process)


@pytest.fixture
def seeded_data_dir(tmp_path, smollm2_dir, smollm2_metadata_dir) -> Path:
    data_dir = tmp_path / "data"
    seed_embedded_model(data_dir, smollm2_dir, smollm2_metadata_dir)
    return data_dir


def _list_models(server: _Server, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=10)


@dataclass
class _FirstStart:
    """A first ``loramux serve`` on a fresh (seeded) data directory, stopped since: what it
    wrote and printed, and its answers while it ran."""

    data_dir: Path
    server: _Server
    token: str  # admin_token as the first start wrote it
    models: httpx.Response  # GET /v1/models with that token
    unauthorized: httpx.Response  # GET /v1/models without a token


@pytest.fixture(scope="module")
def first_start(tmp_path_factory, smollm2_metadata_dir) -> _FirstStart:
    """One first start for the module: the first-start test checks it, and the second-start
    test starts again on its data directory (so ``serve`` starts twice, not three times)."""
    root = tmp_path_factory.mktemp("first_start")
    data_dir = root / "data"
    seed_embedded_model(data_dir, smollm2_metadata_dir)  # no setting: served from the GGUF
    with _serving(data_dir, root / "first.log") as server:
        token_file = data_dir / "admin_token"
        assert token_file.is_file()
        token = token_file.read_text().strip()
        models, unauthorized = _list_models(server, token), _list_models(server, None)
    return _FirstStart(data_dir, server, token, models, unauthorized)


def test_serve_first_start_prints_the_token_and_serves_models(first_start):
    server, token = first_start.server, first_start.token
    assert token

    response = first_start.models
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == [EMBEDDED_MODEL_ID]

    unauthorized = first_start.unauthorized
    assert unauthorized.status_code == 401
    assert set(unauthorized.json()["error"]) == {"message", "type", "code"}

    output = server.output()
    assert token in output, output
    curl_lines = [line for line in output.splitlines() if "curl" in line]
    assert any(f"{server.base_url}/v1/models" in line for line in curl_lines), output
    assert any(token in line for line in curl_lines), output
    # The walkthrough: a tenant, its key, an adapter upload and a completion with it.
    assert f"BASE={server.base_url}" in output, output
    assert f"ADMIN_TOKEN={token}" in output, output
    walkthrough = {
        "tenant": "TENANT_ID=$(curl -s $BASE/admin/tenants ",
        "key": "API_KEY=$(curl -s $BASE/admin/tenants/$TENANT_ID/api-keys ",
        "upload": "curl -s $BASE/v1/adapters ",
        "completion": "curl -s $BASE/v1/completions ",
    }
    for step, start in walkthrough.items():
        assert any(start in line for line in curl_lines), f"no {step} curl:\n{output}"
    upload = next(line for line in curl_lines if "$BASE/v1/adapters" in line)
    for part in (
        "-F name=",
        "-F files=@adapter_config.json",
        "-F files=@adapter_model.safetensors",
    ):
        assert part in upload, upload
    assert any('"model": "my-adapter"' in line for line in curl_lines), output
    # The seeded directory was used, not converted again.
    assert "Converting" not in output, output
    # The engine's threads, as many as the test's workers allow (one each: OMP_NUM_THREADS),
    # said at start with the cores the process may use.
    threads = [line for line in output.splitlines() if "Compute threads:" in line]
    assert len(threads) == 1, output
    expected = os.environ.get("OMP_NUM_THREADS")
    if expected is not None:
        assert f"Compute threads: {expected}" in threads[0], threads[0]
    assert "core(s) available to this process" in threads[0], threads[0]


def test_serve_second_start_does_not_print_the_token(first_start, tmp_path):
    # The module's first start ran on this data directory, printed its token and stopped.
    data_dir, token = first_start.data_dir, first_start.token
    assert token in first_start.server.output()

    with _serving(data_dir, tmp_path / "second.log") as second:
        response = _list_models(second, token)
        assert response.status_code == 200, response.text
        assert [card["id"] for card in response.json()["data"]] == [EMBEDDED_MODEL_ID]

    output = second.output()
    assert token not in output, output
    assert "curl" not in output, output
    assert (data_dir / "admin_token").read_text().strip() == token


# --- base model resolution -------------------------------------------------------------------


def test_model_dir_without_config_json_is_rejected(tmp_path):
    model_dir = tmp_path / "not-a-model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"")
    settings = Settings(data_dir=tmp_path / "data", model=str(model_dir))
    with pytest.raises(BaseModelError, match=r"config\.json") as excinfo:
        resolve_base_model(settings, log=lambda _: None)
    assert str(model_dir) in str(excinfo.value)


def test_missing_model_path_is_rejected(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    settings = Settings(data_dir=tmp_path / "data", model=str(missing))
    with pytest.raises(BaseModelError) as excinfo:
        resolve_base_model(settings, log=lambda _: None)
    assert str(missing) in str(excinfo.value)


def test_model_file_that_is_not_gguf_is_rejected(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    settings = Settings(data_dir=tmp_path / "data", model=str(weights))
    with pytest.raises(BaseModelError) as excinfo:
        resolve_base_model(settings, log=lambda _: None)
    assert str(weights) in str(excinfo.value)


def test_hf_model_dir_resolves_to_itself(tmp_path, tiny_model_dir):
    settings = Settings(data_dir=tmp_path / "data", model=str(tiny_model_dir))
    base = resolve_base_model(settings, log=lambda _: None)
    assert base.path == tiny_model_dir.resolve()
    assert base.model_id == tiny_model_dir.name


def test_model_id_setting_renames_the_model(tmp_path, tiny_model_dir):
    settings = Settings(data_dir=tmp_path / "data", model=str(tiny_model_dir), model_id="base")
    assert resolve_base_model(settings, log=lambda _: None).model_id == "base"


def test_embedded_default_serves_the_gguf_s_own_weights(tmp_path):
    settings = Settings(data_dir=tmp_path / "data")
    base = resolve_base_model(settings, log=lambda _: None)
    assert base.model_id == EMBEDDED_MODEL_ID
    assert base.gguf_file == embedded_gguf_path()
    assert base.path == tmp_path / "data" / "models" / f"{EMBEDDED_MODEL_ID}.metadata"
    # Only the config and tokenizer were written: no float copy of the weights.
    written = sum(f.stat().st_size for f in base.path.iterdir() if f.is_file())
    assert (base.path / "config.json").is_file() and written < 8 << 20
    assert not list(base.path.glob("*.safetensors"))
    config = engine_config(settings, base)
    assert config.gguf_file == str(embedded_gguf_path()) and config.quantization == "none"


def test_quantization_none_uses_the_converted_dir_in_the_data_dir(seeded_data_dir):
    settings = Settings(data_dir=seeded_data_dir, quantization="none")
    messages: list[str] = []
    base = resolve_base_model(settings, log=messages.append)
    assert base.model_id == EMBEDDED_MODEL_ID
    assert base.path == seeded_data_dir / "models" / EMBEDDED_MODEL_ID
    assert base.gguf_file is None
    assert messages == [], "a seeded conversion must not be redone"


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantizing_a_gguf_again_is_refused_with_what_to_set(tmp_path, quantization):
    settings = Settings(data_dir=tmp_path / "data", quantization=quantization)
    with pytest.raises(BaseModelError, match="leave LORAMUX_QUANTIZATION unset") as excinfo:
        resolve_base_model(settings, log=lambda _: None)
    assert f"LORAMUX_QUANTIZATION={quantization}" in str(excinfo.value)
    assert not (tmp_path / "data" / "models").exists()


def test_quantization_setting_reaches_the_engine_for_a_float_checkpoint(tmp_path, tiny_model_dir):
    settings = Settings(
        data_dir=tmp_path / "data",
        model=str(tiny_model_dir),
        quantization="int4",
        quantization_group_size=64,
    )
    config = engine_config(settings, resolve_base_model(settings, log=lambda _: None))
    assert (config.quantization, config.quantization_group_size) == ("int4", 64)
    assert config.gguf_file is None
    auto = Settings(data_dir=tmp_path / "data", model=str(tiny_model_dir))
    assert engine_config(auto, resolve_base_model(auto, log=lambda _: None)).quantization == "none"


def test_serve_another_family_s_gguf_on_the_default_settings(tmp_path, gemma3_gguf):
    """``LORAMUX_MODEL=<Gemma 3 270M's GGUF>``, nothing else set: the server serves it from
    its own tensors, and a tenant's greedy completions over HTTP (the ``openai`` client)
    are the in-process engine's tokens for the same prompts."""
    from openai import OpenAI

    from loramux.engine import Engine, EngineConfig, SamplingParams

    gguf_file, metadata_dir = gemma3_gguf
    data_dir = tmp_path / "data"
    seed_embedded_model(data_dir, metadata_dir)  # what a first start writes (25 s of tokenizer)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    with _serving(data_dir, tmp_path / "serve.log", LORAMUX_MODEL=str(gguf_file)) as server:
        admin = {"Authorization": f"Bearer {(data_dir / 'admin_token').read_text().strip()}"}
        tenant = httpx.post(f"{server.base_url}/admin/tenants", json={"name": "t"}, headers=admin)
        key = httpx.post(
            f"{server.base_url}/admin/tenants/{tenant.json()['id']}/api-keys",
            json={},
            headers=admin,
        ).json()["key"]
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key=key)
        (model,) = [card.id for card in client.models.list().data]
        texts = [
            client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0)
            .choices[0]
            .text
            for p in prompts
        ]
        assert "base weights" in server.output() and "int8/g16" in server.output()
    assert model == gguf_file.stem
    engine = Engine(EngineConfig(model=str(metadata_dir), gguf_file=str(gguf_file), device="cpu"))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected = [engine.tokenizer.decode(o.token_ids) for o in engine.generate(prompts, params)]
    assert texts == expected
