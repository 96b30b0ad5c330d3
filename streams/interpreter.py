"""Interpreter settings of our long-running stream processes: the garbage collector (processor,
sink) and the GIL switch interval (processor).

Garbage collector. CPython's default thresholds (700, 10, 10) ran a full collection every ~1.5 s
in the processor under the bench, each 50-300 ms with the GIL held (100-140k tracked objects, a
busy 2-core box) and each freeing nothing: run state is acyclic and freed by reference counting.
In the sink the collector took ~5% of the fold (a harness folding 50,000 events: 0.18-0.25 s of
4.2-5.7 s; 0.01 s with these thresholds). A young collection every 50,000 net allocations still
collects cycles (exceptions, closures), without those stalls.

Switch interval. A thread coming back from a blocking call that released the GIL (librdkafka's
send_offsets_to_transaction and commit_transaction, a Future's wait, a Postgres write) while
another thread runs Python waits up to `sys.getswitchinterval()` (5 ms by default) before it may
ask for the GIL. The processor's committer makes about four such returns per transaction while
the loop thread applies the next batch, so the default put up to ~20 ms into every transaction.
With 0.5 ms, eight interleaved pairs of `agentruns bench processor`: the commit stage's mean
12.7-23.9 ms (median ~15) against 15.8-30.4 ms (median ~20) with the default, the artifacts wait
1.3-3.5 against 2.9-11.3 ms. The executors (a 32-thread pool) and the sink showed no gain
(interleaved pairs within the noise), so they keep the default.
"""

from __future__ import annotations

import gc
import sys

GC_THRESHOLDS = (50_000, 20, 20)
PROCESSOR_SWITCH_INTERVAL_S = 0.0005


def tune_gc() -> None:
    """Collect cycles rarely (call once at process start)."""
    gc.set_threshold(*GC_THRESHOLDS)


def tune_switch_interval(seconds: float = PROCESSOR_SWITCH_INTERVAL_S) -> None:
    """Let a thread returning from a blocking call take the GIL sooner (once per process)."""
    sys.setswitchinterval(seconds)
