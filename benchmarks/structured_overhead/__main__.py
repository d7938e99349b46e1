"""``python -m loramux.benchmarks.structured_overhead``: ``loramux bench structured-overhead``."""

import sys

from loramux.benchmarks.bench import study

sys.exit(study("structured-overhead").main())
