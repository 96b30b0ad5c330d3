"""Submit a task from Python with `RunsProducer`, then wait for its result with `ResultsConsumer`.

    python examples/submit_task.py examples/tasks/refund-7.json refund-7

Kafka comes from KAFKA_BOOTSTRAP_SERVERS (default: the local stack of `agentruns run` or
`agentruns dev up`, 127.0.0.1:19092); topics from AGENTRUNS_TOPIC_PREFIX (default `agentruns`).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

from agentruns.connectors.api.client import ResultsConsumer, RunsProducer


def main(task_file: str, idempotency_key: str) -> int:
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    prefix = os.environ.get("AGENTRUNS_TOPIC_PREFIX", "agentruns")
    task = json.loads(Path(task_file).read_text())
    # Same idempotency key -> same run: submitting again after a crash starts nothing new.
    with RunsProducer(bootstrap, producer_id="examples", prefix=prefix) as producer:
        submission = producer.submit(task, idempotency_key=idempotency_key)
    print(f"submitted {submission.run_id}", flush=True)
    # A group of its own reads every result from the start; a service keeps one stable group
    # id so that it resumes after the last result it handled.
    group = f"examples-{uuid.uuid4().hex[:8]}"
    with ResultsConsumer(bootstrap, group_id=group, prefix=prefix) as results:
        for result in results.results(follow=True):
            if result.run_id == submission.run_id:
                print(f"{result.run_id} {result.summary}")
                results.ack(result)
                return 0
    return 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python examples/submit_task.py TASK_FILE IDEMPOTENCY_KEY")
    sys.exit(main(sys.argv[1], sys.argv[2]))
