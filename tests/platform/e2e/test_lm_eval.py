"""lm-evaluation-harness against ``loramux serve``, as a tenant evaluating its adapter.

``lm-eval``'s ``local-completions`` model scores a multiple-choice task through
``/v1/completions`` with ``echo``, ``logprobs`` and batched token-id prompts, and reads the
log-probabilities of the prompt's own tokens; its generation path sends stop sequences.
The task is built from local files (no hub). Each choice's log-likelihood must equal the
one transformers + PEFT compute directly for the same tokens, to 1e-4.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from tests.engine.hf_reference import greedy_tokens, reference_model
from tests.platform.e2e.serve_process import ServeProcess
from tests.platform.e2e.served_smollm2 import serve_with_adapter

pytestmark = pytest.mark.slow

ADAPTER = "lm-eval-adapter"
QUESTIONS = [
    ("What colour is the sky on a clear day?", ["blue", "green", "red"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten"], 1),
    ("Which animal says moo?", ["a cat", "a dog", "a cow"], 2),
    ("What is frozen water called?", ["ice", "steam", "sand"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
]
GENERATION_PROMPTS = ["Count: one, two, three,", "The days of the week are Monday,"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir, make_adapter) -> Iterator[tuple[ServeProcess, str]]:
    """``loramux serve`` on its defaults (SmolLM2, SQLite, local store), one tenant with
    a real PEFT adapter uploaded over HTTP; yields the server and the tenant's key."""
    adapter_dir = make_adapter(smollm2_dir, rank=8, targets=("q_proj", "v_proj"), seed=7)
    root = tmp_path_factory.mktemp("lm-eval")
    with serve_with_adapter(root, smollm2_dir, adapter_dir, ADAPTER) as server_and_key:
        yield server_and_key


def write_tasks(folder: Path) -> Path:
    """A multiple-choice and a generation task, as lm-eval YAML over local JSON lines."""
    mc = folder / "mc.jsonl"
    mc.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    gen = folder / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in GENERATION_PROMPTS))
    (folder / "loramux_mc.yaml").write_text(
        f"""task: loramux_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
    )
    (folder / "loramux_gen.yaml").write_text(
        f"""task: loramux_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: ""
generation_kwargs:
  until: [","]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""
    )
    return folder


def evaluate(served, tasks_dir: Path, task: str, monkeypatch) -> tuple[dict, object]:
    serve, key = served
    monkeypatch.setenv("OPENAI_API_KEY", key)  # local-completions reads its key from here
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = get_model("local-completions")(
        base_url=f"{serve.url}/v1/completions",
        model=ADAPTER,
        tokenizer=str(serve.settings["MODEL"]),
        tokenizer_backend="huggingface",
        batch_size=4,  # several token-id prompts in one request
        max_retries=1,
    )
    results = simple_evaluate(
        model=model,
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
    )
    return results, model


@torch.inference_mode()
def reference_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    positions = range(len(context) - 1, len(context) + len(continuation) - 1)
    return sum(float(logprobs[p, ids[0, p + 1]]) for p in positions)


def test_lm_eval_choice_loglikelihoods_equal_transformers_peft(
    served, tmp_path, monkeypatch, smollm2_dir, make_adapter
):
    results, lm = evaluate(served, write_tasks(tmp_path), "loramux_mc", monkeypatch)
    samples = results["samples"]["loramux_mc"]
    assert len(samples) == len(QUESTIONS)
    adapter_dir = make_adapter(smollm2_dir, rank=8, targets=("q_proj", "v_proj"), seed=7)
    reference = reference_model(smollm2_dir, adapter_dir)
    worst = 0.0
    for sample in samples:
        # One (context, continuation) per choice; its response is [(loglikelihood, greedy)].
        for (context, continuation), [(loglikelihood, _)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            expected = reference_loglikelihood(reference, context_ids, continuation_ids)
            worst = max(worst, abs(loglikelihood - expected))
            assert loglikelihood == pytest.approx(expected, abs=1e-4), (context, continuation)
    print(f"lm-eval vs transformers + PEFT: worst |delta log-likelihood| {worst:.2e}")
    assert "acc,none" in results["results"]["loramux_mc"]


def test_lm_eval_generation_stops_at_its_stop_sequence(
    served, tmp_path, monkeypatch, smollm2_dir, make_adapter, tokenizer
):
    results, _ = evaluate(served, write_tasks(tmp_path), "loramux_gen", monkeypatch)
    samples = results["samples"]["loramux_gen"]
    assert len(samples) == len(GENERATION_PROMPTS)
    adapter_dir = make_adapter(smollm2_dir, rank=8, targets=("q_proj", "v_proj"), seed=7)
    for sample in samples:
        prompt = sample["arguments"][0][0]
        generated = sample["resps"][0][0]
        # The same request greedily through transformers + PEFT, cut at the stop string.
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        expected = tokenizer.decode(greedy_tokens(smollm2_dir, adapter_dir, ids, 12))
        print("generated", repr(generated), "reference", repr(expected))
        assert "," not in generated
        assert generated == expected.split(",")[0], (prompt, generated, expected)
