"""What the benchmark studies share: the one runner shape (``study``) and the one report
writer (``report``); the workloads (``workload``, S-LoRA's own in ``slora_workloads``),
the models, adapters and prompts they serve (``models``, ``adapters``, ``prompts``); the
drivers that serve a workload on the engine, the platform over HTTP or transformers +
PEFT (``drivers`` and ``driver_*``); the platform in-process and its admin calls
(``bench_server``) and a real ``loramux serve`` process (``serve_process``); what a run
measured (``measures``, ``step_trace``, ``adapter_traffic``), the machine it ran on
(``machine``), another revision's engine beside this one (``revisions``) and where
results go (``files``)."""
