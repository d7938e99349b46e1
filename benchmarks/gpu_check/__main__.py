"""``python -m loramux.benchmarks.gpu_check``: ``loramux bench gpu-check``."""

import sys

from loramux.benchmarks.bench import study

sys.exit(study("gpu-check").main())
