"""What the benchmark studies share: the workloads (``workload``, S-LoRA's own in
``slora_workloads``), the models, adapters and prompts they serve (``models``,
``adapters``, ``prompts``), the drivers that serve a workload on the engine, the platform
over HTTP or transformers + PEFT (``drivers`` and ``driver_*``, the in-process server in
``bench_server``), what a run measured (``measures``, ``step_trace``,
``adapter_traffic``), the machine it ran on (``machine``) and where results go
(``files``)."""
