"""``python -m loramux.benchmarks.cold_adapter_flood``: ``loramux bench cold-adapter-flood``."""

import sys

from loramux.benchmarks.bench import study

sys.exit(study("cold-adapter-flood").main())
