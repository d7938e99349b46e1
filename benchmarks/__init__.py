"""loramux's benchmarks, ``loramux.benchmarks``: ``loramux bench NAME`` (``bench``).

One package per study (its ``runner`` and, where it has one, its ``report``), each a
``common.study.Study``; what they share is in ``common``: workloads, drivers that serve
them on the engine, the platform over HTTP or transformers + PEFT, what a run measured,
and the one report writer (``common.report``). The serve presets are in
``serve.presets``. Recorded results are in the source checkout's ``benchmarks/results/``.
"""
