"""``python -m loramux.engine.parallel SPEC``: a tensor-parallel rank's process (the command
rank 0 starts it with: ``worker.rank_command``)."""

import json
import sys

from loramux.engine.config import EngineConfig
from loramux.engine.parallel.group import GroupAddress
from loramux.engine.parallel.worker import run_rank

spec = json.loads(sys.argv[1])
run_rank(
    EngineConfig(**spec["config"]),
    spec["rank"],
    GroupAddress(**spec["address"]),
    spec["threads"],
    spec["heartbeat_fd"],
)
