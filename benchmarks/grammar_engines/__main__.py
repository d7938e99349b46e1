"""``python -m loramux.benchmarks.grammar_engines``: ``loramux bench grammar-engines``."""

import sys

from loramux.benchmarks.bench import study

sys.exit(study("grammar-engines").main())
