"""``python -m loramux.benchmarks.tensor_parallel``: ``loramux bench tensor-parallel``."""

import sys

from loramux.benchmarks.bench import study

sys.exit(study("tensor-parallel").main())
