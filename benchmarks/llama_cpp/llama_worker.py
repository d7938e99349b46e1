"""llama.cpp's side of ``loramux bench llama-cpp``: one workload on the embedded GGUF.

Run by ``--llama-cpp-python``'s interpreter as a script, ``python llama_worker.py JOB.json
RESULT.json``, so it imports only the standard library, numpy and ``llama_cpp`` (token ids
and file paths come in the job; no tokenizer here). It drives llama.cpp through
llama-cpp-python's low-level API, the C functions themselves, with the least Python between
two of llama.cpp's steps: ``llama_decode`` on a ``llama_batch`` filled here, then greedy
argmax in numpy over ``llama_get_logits_ith`` (the ids in ``suppress``, the model's EOS,
masked first: every request runs its full length, as the engine's ``min_tokens`` and
PEFT's ``min_new_tokens`` make it). Context: ``n_threads`` = ``n_threads_batch`` = the
job's threads, ``n_batch`` 2048 and ``n_ubatch`` 512 (llama.cpp's defaults), the rest
llama.cpp's defaults (flash attention ``auto``, an F16 KV cache).

Workloads (``job["workload"]``):

* ``prefill``: the prompt in one request (``n_batch`` tokens per ``llama_decode``), logits
  for its last token only, one greedy token; seconds from the first ``llama_decode`` to
  that token.
* ``decode``: one request, one sequence; the prompt, then one ``llama_decode`` of one token
  per new token; the seconds after the first token.
* ``mixed``: every request at once on one context with ``n_seq_max`` = the request count
  and a KV cache per sequence (``kv_unified`` off: sequences that share no prefix);
  each step, for each adapter's group of sequences in turn, that adapter set on the context
  (``llama_set_adapters_lora``) and one ``llama_decode`` of the group's tokens (its
  prompts first). That is what llama.cpp's server does when its slots carry different
  LoRAs: a batch holds only slots whose adapters are equal, the rest wait for the next.

A warm-up before each (a short prompt and a few tokens, each adapter once) keeps first-call
costs out of the timings.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import llama_cpp as lc
import numpy as np

N_BATCH = 2048  # tokens per llama_decode (llama.cpp's default)
N_UBATCH = 512  # tokens per compute pass within one (its default)
WARMUP_PROMPT = list(range(100, 132))  # 32 tokens none of the workloads starts with
WARMUP_TOKENS = 4


class Clock:
    """This process's CPU seconds over a block's wall seconds, and the 1-minute load around
    it: the figures of loramux's ``benchmarks.common.machine.Clock.summary()``, which this
    script cannot import."""

    def __enter__(self) -> Clock:
        self.load_before = os.getloadavg()[0]
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        cpu, wall = time.process_time() - self.cpu, time.perf_counter() - self.wall
        self.summary = {
            "cpu_seconds": round(cpu, 2),
            "cores_used": round(cpu / wall, 2),
            "loadavg_1m_before": round(self.load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        }


class Model:
    """The GGUF loaded once; its contexts are made per workload."""

    def __init__(self, gguf: str):
        lc.llama_backend_init()
        # llama.cpp logs every load to stderr; the callback is kept referenced while used.
        self._quiet = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(self._quiet, ctypes.c_void_p())
        self.model = lc.llama_model_load_from_file(gguf.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def adapter(self, path: str):
        adapter = lc.llama_adapter_lora_init(self.model, path.encode())
        if not adapter:
            raise RuntimeError(f"llama.cpp could not load the LoRA {path}")
        return adapter


class Context:
    """One llama.cpp context: a batch to fill, decode, and greedy tokens from its logits."""

    def __init__(self, model: Model, *, threads: int, n_ctx: int, n_seq: int, suppress):
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx, n_seq
        params.n_batch, params.n_ubatch = N_BATCH, N_UBATCH
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        self.flash_attn = lc.llama_flash_attn_type_name(params.flash_attn_type).decode()
        self.ctx = lc.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make its context")
        self.model, self.n_ctx = model, lc.llama_n_ctx(self.ctx)
        self.batch = lc.llama_batch_init(N_BATCH, 0, 1)
        self.suppress = np.asarray(suppress, dtype=np.int64)
        self.adapter_set = None

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)

    def clear(self) -> None:
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)

    def use_adapter(self, adapter) -> None:
        """Only ``adapter`` (None: none) on the context from the next decode on."""
        if adapter is self.adapter_set:
            return
        if adapter is None:
            done = lc.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            adapters = (lc.llama_adapter_lora_p_ctypes * 1)(adapter)
            done = lc.llama_set_adapters_lora(self.ctx, adapters, 1, (ctypes.c_float * 1)(1.0))
        if done != 0:
            raise RuntimeError(f"llama_set_adapters_lora returned {done}")
        self.adapter_set = adapter

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """``entries``: (token, position, sequence, whether its next token is wanted), at
        most ``N_BATCH``; the greedy next token of each wanted entry, in order."""
        if not 0 < len(entries) <= N_BATCH:
            raise ValueError(f"a batch of {len(entries)} tokens (at most {N_BATCH})")
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, wanted) in enumerate(entries):
            batch.token[i], batch.pos[i] = token, pos
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
            batch.logits[i] = wanted
        done = lc.llama_decode(self.ctx, batch)
        if done != 0:
            raise RuntimeError(f"llama_decode returned {done}")
        wanted = [i for i, entry in enumerate(entries) if entry[3]]
        return [self._greedy(i) for i in wanted]

    def _greedy(self, index: int) -> int:
        pointer = lc.llama_get_logits_ith(self.ctx, index)
        logits = np.ctypeslib.as_array(pointer, shape=(self.model.n_vocab,))
        logits[self.suppress] = -np.inf  # llama.cpp's own buffer, read once
        return int(logits.argmax())

    def prompt(self, tokens: list[int], seq: int = 0) -> int:
        """The prompt of sequence ``seq`` from position 0, ``N_BATCH`` tokens per decode;
        its first greedy token."""
        for start in range(0, len(tokens), N_BATCH):
            chunk = tokens[start : start + N_BATCH]
            last = start + len(chunk) == len(tokens)
            entries = [
                (t, start + k, seq, last and k == len(chunk) - 1) for k, t in enumerate(chunk)
            ]
            out = self.decode(entries)
        return out[0]

    def generate(self, prompt: list[int], count: int, stamps: list[float] | None = None):
        """``count`` greedy tokens after ``prompt`` on sequence 0; ``stamps`` gets the time
        each token was there."""
        tokens = [self.prompt(prompt)]
        if stamps is not None:
            stamps.append(time.perf_counter())
        while len(tokens) < count:
            [token] = self.decode([(tokens[-1], len(prompt) + len(tokens) - 1, 0, True)])
            tokens.append(token)
            if stamps is not None:
                stamps.append(time.perf_counter())
        return tokens


def _context_length(tokens: int) -> int:
    return -(-tokens // 256) * 256  # llama.cpp pads each sequence's context to 256


def prefill(model: Model, job: dict) -> dict:
    prompt = job["prompt"]
    ctx = Context(
        model,
        threads=job["threads"],
        n_ctx=_context_length(len(prompt) + 1),
        n_seq=1,
        suppress=job["suppress"],
    )
    try:
        ctx.generate(WARMUP_PROMPT, WARMUP_TOKENS)
        ctx.clear()
        with Clock() as clock:
            start = time.perf_counter()
            token = ctx.prompt(prompt)
            seconds = time.perf_counter() - start
    finally:
        ctx.close()
    return {
        "seconds": seconds,
        "tokens": [token],
        "clock": clock.summary,
        "flash_attn": ctx.flash_attn,
    }


def decode(model: Model, job: dict) -> dict:
    prompt, count = job["prompt"], job["max_tokens"]
    ctx = Context(
        model,
        threads=job["threads"],
        n_ctx=_context_length(len(prompt) + count),
        n_seq=1,
        suppress=job["suppress"],
    )
    stamps: list[float] = []
    try:
        ctx.generate(WARMUP_PROMPT, WARMUP_TOKENS)
        ctx.clear()
        with Clock() as clock:
            start = time.perf_counter()
            tokens = ctx.generate(prompt, count, stamps)
    finally:
        ctx.close()
    return {
        "ttft_s": stamps[0] - start,
        "decode_s": stamps[-1] - stamps[0],
        "tokens": tokens,
        "clock": clock.summary,
        "flash_attn": ctx.flash_attn,
    }


def serve_grouped(ctx: Context, prompts, groups: list, count: int) -> list[list[int]]:
    """Every request's ``count`` tokens, ``groups`` ((an adapter, its requests), ...) decoded
    one after another at each step, each with its adapter alone on the context."""
    tokens: list[list[int]] = [[] for _ in prompts]
    for adapter, members in groups:  # the prompts, a group per decode
        ctx.use_adapter(adapter)
        entries = [
            (t, k, r, k == len(prompts[r]) - 1) for r in members for k, t in enumerate(prompts[r])
        ]
        for r, token in zip(members, ctx.decode(entries), strict=True):
            tokens[r].append(token)
    while any(len(t) < count for t in tokens):
        for adapter, members in groups:
            going = [r for r in members if len(tokens[r]) < count]
            if not going:
                continue
            ctx.use_adapter(adapter)
            position = [len(prompts[r]) + len(tokens[r]) - 1 for r in going]
            entries = [(tokens[r][-1], p, r, True) for r, p in zip(going, position, strict=True)]
            for r, token in zip(going, ctx.decode(entries), strict=True):
                tokens[r].append(token)
    return tokens


def mixed(model: Model, job: dict) -> dict:
    """Every request at once, grouped by adapter at each step (see the module docstring)."""
    prompts, count = job["prompts"], job["max_tokens"]
    files = job["adapter_files"]  # request -> its adapter's GGUF LoRA file
    loaded = {path: model.adapter(path) for path in dict.fromkeys(files)}
    members: dict[str, list[int]] = {}
    for request, path in enumerate(files):
        members.setdefault(path, []).append(request)
    groups = [(loaded[path], requests) for path, requests in members.items()]
    per_seq = _context_length(max(map(len, prompts)) + count)
    ctx = Context(
        model,
        threads=job["threads"],
        n_ctx=per_seq * len(prompts),
        n_seq=len(prompts),
        suppress=job["suppress"],
    )
    try:
        for adapter in loaded.values():  # warm-up: each adapter once
            ctx.use_adapter(adapter)
            ctx.generate(WARMUP_PROMPT, WARMUP_TOKENS)
            ctx.clear()
        with Clock() as clock:
            start = time.perf_counter()
            tokens = serve_grouped(ctx, prompts, groups, count)
            seconds = time.perf_counter() - start
    finally:
        ctx.close()  # the adapters go with the model
    return {
        "seconds": seconds,
        "tokens": tokens,
        "clock": clock.summary,
        "n_ctx": ctx.n_ctx,
        "groups": len(groups),
        "flash_attn": ctx.flash_attn,
    }


WORKLOADS = {"prefill": prefill, "decode": decode, "mixed": mixed}


def main(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    model = Model(job["gguf"])
    try:
        result = WORKLOADS[job["workload"]](model, job)
    finally:
        lc.llama_model_free(model.model)
    result["version"] = lc.__version__
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
