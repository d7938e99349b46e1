"""``python -m loramux.benchmarks.grammar_cache_memory``: ``loramux bench grammar-cache-memory``."""

import sys

from loramux.benchmarks.bench import study

sys.exit(study("grammar-cache-memory").main())
