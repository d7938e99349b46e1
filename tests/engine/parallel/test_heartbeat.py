"""A rank's heartbeat goes on while its main thread computes (Python and torch ops alike),
so rank 0's watch reports nothing of a busy rank; once the rank's process is stopped, the
watch reports it, by its rank number, within a bound of the heartbeat timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from loramux.engine.parallel.heartbeat import HeartbeatWatch, beat_interval_s

TIMEOUT_S = 1.0
BUSY_S = 2.0  # twice the timeout
RANK = 3

# A rank's process, reduced to its heartbeat and a long step: Python code and torch ops.
BUSY_RANK = """
import sys, time, torch
from loramux.engine.parallel.heartbeat import start_heartbeat
torch.set_num_threads(1)
start_heartbeat(int(sys.argv[1]), float(sys.argv[2]))
print("beating", flush=True)
deadline = time.monotonic() + float(sys.argv[3])
matrix = torch.randn(256, 256)
while time.monotonic() < deadline:
    matrix = (matrix @ matrix).tanh()
    sum(range(10_000))
print("done", flush=True)
time.sleep(600)
"""


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_busy_rank_beats_and_a_stopped_one_is_named():
    reports: list[tuple[int, float]] = []
    watch = HeartbeatWatch(TIMEOUT_S, lambda rank, silent_s: reports.append((rank, silent_s)))
    fd = watch.pipe(RANK)
    command = [sys.executable, "-c", BUSY_RANK, str(fd), str(beat_interval_s(TIMEOUT_S))]
    process = subprocess.Popen(
        [*command, str(BUSY_S)], pass_fds=(fd,), stdout=subprocess.PIPE, text=True
    )
    os.close(fd)  # the rank's end: its exit closes the pipe
    watch.start()
    try:
        assert process.stdout.readline() == "beating\n"
        assert process.stdout.readline() == "done\n"
        assert reports == [] and watch.silent_ranks() == {}

        process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert _wait_for(lambda: reports, 3 * TIMEOUT_S), "no report of the stopped rank"
        waited = time.monotonic() - stopped
        ((rank, silent_s),) = reports
        assert rank == RANK and TIMEOUT_S < silent_s < 3 * TIMEOUT_S
        assert waited < 3 * TIMEOUT_S  # silent since its last beat, a little before the stop
        assert RANK in watch.silent_ranks()

        process.kill()  # a stopped process dies of SIGKILL too
        process.wait(10)
        # Its exit closed its pipe: it is no longer watched, and nothing is reported twice.
        assert _wait_for(lambda: watch.silent_ranks() == {}, 3 * TIMEOUT_S)
        assert len(reports) == 1
    finally:
        process.kill()
        process.wait(10)
        watch.stop()
