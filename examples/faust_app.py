"""A Faust app that submits tasks to agentruns and consumes their terminal results.

    pip install 'agentruns[faust]'
    python examples/faust_app.py worker --loglevel=info

At start it submits every `*.json` task of AGENTRUNS_FAUST_TASKS (default examples/tasks), the
file's stem as the idempotency key, so a restarted worker submits the same runs again and none
runs twice. Its agent prints every terminal result on `<prefix>.results`, one line each:
`result <run_id> <status> v<version> <summary>`. Kafka comes from KAFKA_BOOTSTRAP_SERVERS
(default: the local stack of `agentruns dev up`, 127.0.0.1:19092); topics from
AGENTRUNS_TOPIC_PREFIX (default `agentruns`); the consumer group is the app id,
AGENTRUNS_FAUST_APP_ID (default `agentruns-faust-example`). With AGENTRUNS_FAUST_TENANT and that
tenant's Kafka key in AGENTRUNS_TENANT_KAFKA_KEY (`agentruns credentials kafka-key --tenant T`),
the tasks are submitted for that tenant, in a signed tenant header (docs/security.md).

The app is made with processing_guarantee="exactly_once" (`agentruns.connectors.faust.app`):
without it Faust reads read_uncommitted, and would see the records of transactions the
processor aborted and then writes again.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import AsyncIterable
from pathlib import Path
from typing import Any

from agentruns.connectors.faust import app as faust_app
from agentruns.connectors.faust import inbox_topic, results_topic, submit_task
from agentruns.connectors.keys import producer_tenant_key

BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:19092")
PREFIX = os.environ.get("AGENTRUNS_TOPIC_PREFIX", "agentruns")
APP_ID = os.environ.get("AGENTRUNS_FAUST_APP_ID", "agentruns-faust-example")
TASKS = Path(os.environ.get("AGENTRUNS_FAUST_TASKS", Path(__file__).parent / "tasks"))
TENANT = os.environ.get("AGENTRUNS_FAUST_TENANT") or None
TENANT_KEY = producer_tenant_key() if TENANT else None

app = faust_app(
    APP_ID,
    BOOTSTRAP,
    processing_guarantee="exactly_once",
    # Faust keeps table state here; this app has no tables, so a temporary place will do.
    datadir=os.environ.get("AGENTRUNS_FAUST_DATA", Path(tempfile.gettempdir()) / APP_ID),
    web_enabled=False,
)
inbox = inbox_topic(app, PREFIX)
results = results_topic(app, PREFIX)


@app.task
async def submit_tasks() -> None:
    for path in sorted(TASKS.glob("*.json")):
        task = json.loads(path.read_text())
        submission = await submit_task(
            inbox,
            task,
            idempotency_key=path.stem,
            producer_id="faust-example",
            tenant=TENANT,
            tenant_key=TENANT_KEY,
        )
        print(f"submitted {path.stem} {submission.run_id}", flush=True)


@app.agent(results)
async def terminal_results(stream: AsyncIterable[dict[str, Any]]) -> None:
    async for result in stream:
        print(
            f"result {result['run_id']} {result['status']} v{result['version']}"
            f" {result['summary']}",
            flush=True,
        )


if __name__ == "__main__":
    app.main()
