"""``python -m loramux.benchmarks.kernels_gpu``: ``loramux bench kernels-gpu``."""

import sys

from loramux.benchmarks.bench import study

sys.exit(study("kernels-gpu").main())
