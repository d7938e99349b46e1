"""loramux's benchmarks, ``loramux.benchmarks``: ``loramux bench PRESET`` (``bench``).

Workloads (``workload``), drivers that serve them on the engine, the platform over HTTP
or transformers + PEFT (``drivers``), what a run measured (``measures``) and how it is
reported (``bench_report``); the presets that combine them (``bench_presets``). Recorded
results are in the source checkout's ``benchmarks/results/``.
"""
