"""``loramux bench llama-cpp``: its options, its report (with llama.cpp and without), and
llama.cpp's side on a tiny workload: the worker script run by an interpreter that imports
``llama_cpp`` (this one, or the one ``LORAMUX_LLAMA_CPP_PYTHON`` names), on the embedded
GGUF with adapters converted by ``gguf_lora``. Where no interpreter imports it, that test
skips saying how to install it (a skip CI allows, as a GPU test's: marker ``llama_cpp``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loramux.benchmarks.bench import study
from loramux.benchmarks.common.adapters import ALL_SEVEN, adapter_config, lora_tensors
from loramux.benchmarks.common.adapters import write_adapter as write_peft_adapter
from loramux.benchmarks.common.llama_cpp_python import CMAKE_ARGS, INSTALL, find_llama_cpp
from loramux.benchmarks.llama_cpp import report
from loramux.benchmarks.llama_cpp.gguf_lora import write_gguf_lora
from loramux.benchmarks.llama_cpp.runner import LLAMA_WORKER, agreement, summarize
from tests.benchmarks.commands import REPO_ROOT

LLAMA_CPP_PYTHON_ENV = "LORAMUX_LLAMA_CPP_PYTHON"


def test_the_options_and_their_defaults(tmp_path):
    args = study("llama-cpp").parse(["--out", str(tmp_path)])
    assert args.workloads == ["prefill", "decode", "mixed"]
    assert (args.rounds, args.threads) == (3, 2)
    assert (args.prefill_tokens, args.decode_tokens, args.mixed_tokens) == (2000, 128, 64)
    assert args.tag is None and args.llama_cpp_python is None
    argv = ["--workloads", "decode", "prefill", "decode", "--rounds", "1", "--threads", "1"]
    argv += ["--decode-tokens", "16", "--tag", "quick", "--llama-cpp-python", "/x/python"]
    args = study("llama-cpp").parse([*argv, "--out", str(tmp_path)])
    assert args.workloads == ["decode", "prefill"]  # once each, in the order given
    assert (args.rounds, args.threads, args.decode_tokens, args.tag) == (1, 1, 16, "quick")
    assert args.llama_cpp_python == Path("/x/python")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "0"], "--rounds must be positive"),
        (["--threads", "0", "--mixed-tokens", "0"], "--threads, --mixed-tokens must be positive"),
        (["--decode-tokens", "1"], "--decode-tokens must be at least 2"),
        (["--prefill-tokens", "9000"], "--prefill-tokens must be at most 8,000"),
        (["--workloads", "train"], "invalid choice: 'train'"),
    ],
)
def test_bad_options_are_usage_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        study("llama-cpp").parse([*argv, "--out", str(tmp_path)])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


def test_the_makefile_builds_llama_cpp_as_the_reports_say():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert f"LLAMA_CPP_CMAKE_ARGS ?= {CMAKE_ARGS}\n" in makefile
    assert "llama-cpp:" in makefile and "make llama-cpp" in INSTALL


def test_an_interpreter_without_llama_cpp_is_said_so(tmp_path):
    found, why = find_llama_cpp(tmp_path / "no-python")
    assert found is None and "could not be run" in why


def test_agreement_counts_tokens_up_to_each_first_difference():
    found = agreement([[1, 2, 3], [4, 9, 6], [7, 8, 9]], [[1, 2, 3], [4, 5, 6], [0, 8, 9]])
    assert found == {"requests_identical": 1, "requests": 3, "tokens_matching": 4, "tokens": 9}


def _report(llama: dict, rows: list[dict]) -> dict:
    from loramux.benchmarks.common.machine import machine_info

    return {
        "command": "loramux bench llama-cpp",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "threads": 2,
        "rounds": 1,
        "workloads": {
            "prefill": {"prompt_tokens": 2000},
            "decode": {"prompt_tokens": 37, "new_tokens": 128},
            "mixed": {"requests": 16, "adapters": [{}] * 8, "prompt_tokens": [37] * 16},
        },
        "llama_cpp": llama,
        "machine": machine_info(),
        "contended": False,
        "summary": summarize(rows, ["decode"]),
        "checks": {},
        "rows": rows,
    }


def _row(engine: str, tokens_per_s: float) -> dict:
    clock = {"cores_used": 2.0}
    return {"engine": engine, "workload": "decode", "round": 0, "tokens": 127, "clock": clock} | {
        "seconds": 127 / tokens_per_s,
        "tokens_per_s": tokens_per_s,
        "ttft_s": 0.05,
    }


def test_the_report_with_llama_cpp_and_without(tmp_path):
    llama = {"version": "0.3.36", "system_info": "AVX2 = 1", "cmake_args": CMAKE_ARGS}
    both = _report(llama, [_row("loramux", 300.0), _row("llama.cpp", 150.0)])
    assert both["summary"] == [
        {
            "workload": "decode",
            "loramux_tokens_per_s": 300.0,
            "llama_cpp_tokens_per_s": 150.0,
            "ratio": 2.0,
        }
    ]
    [plot] = report.write_plot(both, tmp_path / "both")
    text = report.markdown(both, [plot]).render()
    assert "| **2.00x** |" in text and CMAKE_ARGS in text and "llama-cpp-python 0.3.36" in text
    assert plot.stat().st_size > 0

    skipped = {"skipped": "python cannot import llama_cpp", "install": INSTALL}
    alone = _report(skipped, [_row("loramux", 300.0)])
    assert alone["summary"][0]["ratio"] is None
    text = report.markdown(alone, report.write_plot(alone, tmp_path / "alone")).render()
    assert "**llama.cpp was skipped**: python cannot import llama_cpp" in text
    assert "`make llama-cpp`" in text


# --- llama.cpp's side, where llama-cpp-python is installed ------------------------------


@pytest.fixture(scope="session")  # set up before the session's model fixtures: skips first
def llama_cpp():
    python = os.environ.get(LLAMA_CPP_PYTHON_ENV)
    found, why = find_llama_cpp(Path(python) if python else None)
    if found is None:
        pytest.skip(
            f"llama.cpp is not installed: {why}; install it with {INSTALL}, or name an "
            f"interpreter that imports llama_cpp in {LLAMA_CPP_PYTHON_ENV}"
        )
    return found


@pytest.mark.llama_cpp
def test_llama_cpp_serves_the_workloads_and_the_converted_adapters(
    llama_cpp, smollm2_metadata_dir, tmp_path
):
    from loramux.benchmarks.common.llama_cpp_python import run_script
    from loramux.engine.model.config import ModelConfig
    from loramux.platform.base_model import embedded_gguf_path

    config = ModelConfig.from_pretrained(smollm2_metadata_dir)
    files = {}
    for name, std in (("none", 0.0), ("strong", 0.3)):  # no change, and a large one
        tensors = lora_tensors(config, 4, ALL_SEVEN, seed=3, a_std=0.3, b_std=std)
        write_peft_adapter(tmp_path / name, tensors, adapter_config(4, ALL_SEVEN))
        files[name] = str(write_gguf_lora(tmp_path / name, config, tmp_path / f"{name}.gguf"))
    prompt = list(range(200, 216))
    base = {"gguf": str(embedded_gguf_path()), "threads": 1, "suppress": list(config.eos_token_ids)}

    def serve(workload: str, **job) -> dict:
        job = base | {"workload": workload} | job
        result = run_script(llama_cpp.python, LLAMA_WORKER, job, tmp_path, threads=1)
        assert result["version"] == llama_cpp.version
        return result

    prefill = serve("prefill", prompt=list(range(300, 364)))
    assert len(prefill["tokens"]) == 1 and prefill["seconds"] > 0
    decode = serve("decode", prompt=prompt, max_tokens=5)
    assert len(decode["tokens"]) == 5 and decode["ttft_s"] > 0 and decode["decode_s"] > 0
    assert not set(decode["tokens"]) & set(config.eos_token_ids)
    mixed = serve(
        "mixed",
        prompts=[prompt, prompt, prompt, prompt[:12]],
        adapter_files=[files["strong"], files["none"], files["strong"], files["none"]],
        max_tokens=4,
    )
    tokens = mixed["tokens"]
    assert [len(t) for t in tokens] == [4] * 4 and mixed["groups"] == 2
    assert tokens[0] == tokens[2]  # one adapter, one prompt: one answer
    assert tokens[0] != tokens[1]  # llama.cpp applied the converted adapter
    assert tokens[1][0] == decode["tokens"][0]  # a zero delta leaves the base's first token
