"""Where a run's time went, from the timestamps of its committed records.

Every record a run leaves is stamped when it was produced (CreateTime): the processor's effects
(``effects.model``, ``effects.tool``) and the executors' answers (the inbox). Laid end to end
per run, the gap from an effect to the answer after it is that executor's hop (the processor's
commit of the effect, the executor's poll, the call, its records, its produce), and the gap
from an answer to the next effect the processor's hop (the executor's commit, the processor's
poll and transition). Sequential steps only: a run with calls in parallel interleaves them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import pairwise

from confluent_kafka import Consumer, KafkaError, TopicPartition

from agentruns.bench.latency import percentile
from agentruns.streams.kafka_defaults import client_settings, close_consumer
from agentruns.streams.topics import INBOX, topic_name

#: The effect topics whose records open an executor's hop, and the hop's name.
EFFECT_HOPS: Mapping[str, str] = {"effects.model": "model", "effects.tool": "tool"}
HOPS = ("processor", *EFFECT_HOPS.values())


def _stamped(
    bootstrap: str, prefix: str, partitions: int, run_ids: Collection[str]
) -> dict[str, list[tuple[int, str]]]:
    """run id -> its records' (timestamp ms, hop that record opens), in timestamp order."""
    topics = [topic_name(INBOX, prefix), *(topic_name(t, prefix) for t in EFFECT_HOPS)]
    wanted = {r.encode() for r in run_ids}
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            **client_settings(),
            "group.id": "bench-hops",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    out: dict[str, list[tuple[int, str]]] = {}
    try:
        assigned = [TopicPartition(t, p, 0) for t in topics for p in range(partitions)]
        consumer.assign(assigned)
        left = len(assigned)
        idle = 0
        while left and idle < 20:
            msgs = consumer.consume(1000, 0.5)
            idle = 0 if msgs else idle + 1
            for msg in msgs:
                error = msg.error()
                if error is not None:
                    left -= error.code() == KafkaError._PARTITION_EOF
                    continue
                key = msg.key()
                if key not in wanted or not isinstance(key, bytes):
                    continue
                topic = (msg.topic() or "").removeprefix(f"{prefix}.")
                opens = EFFECT_HOPS.get(topic, "processor")
                out.setdefault(key.decode(), []).append((msg.timestamp()[1], opens))
    finally:
        close_consumer(consumer, 10)
    for records in out.values():
        records.sort()
    return out


def hop_splits(
    bootstrap: str, prefix: str, partitions: int, groups: Mapping[str, Collection[str]]
) -> dict[str, dict[str, float]]:
    """Per group of runs (name -> run ids), per hop (processor, model, tool): the median over
    the group's runs of the milliseconds each spent in it. The topics are read once for all."""
    stamped = _stamped(bootstrap, prefix, partitions, {r for ids in groups.values() for r in ids})
    return {
        name: median_split(stamped[r] for r in ids if r in stamped) for name, ids in groups.items()
    }


def hop_overheads(
    bootstrap: str,
    prefix: str,
    partitions: int,
    runs: Collection[str],
    backends: Mapping[str, Mapping[str, float]],
) -> dict[str, float]:
    """Per hop, the median over ``runs`` of the milliseconds each spent in it beyond its own
    backends' time there (`median_overhead`)."""
    stamped = _stamped(bootstrap, prefix, partitions, runs)
    return median_overhead({r: stamped[r] for r in runs if r in stamped}, backends)


def spent(records: Sequence[tuple[int, str]]) -> dict[str, float]:
    """Per hop, the milliseconds a run spent in it, from its records' (timestamp ms, hop that
    record opens), in order (0 for a hop it never entered)."""
    out = dict.fromkeys(HOPS, 0.0)
    for (at, opens), (after, _) in pairwise(records):
        out[opens] += after - at
    return out


def median_split(runs: Iterable[Sequence[tuple[int, str]]]) -> dict[str, float]:
    """Per hop, the median over ``runs`` (each its records' (timestamp ms, hop it opens), in
    order) of the milliseconds the run spent in that hop; no figures without runs."""
    per_run: dict[str, list[float]] = {hop: [] for hop in HOPS}
    for records in runs:
        for hop, ms in spent(records).items():
            per_run[hop].append(ms)
    return {hop: round(percentile(ms, 0.5), 1) for hop, ms in per_run.items() if ms}


def median_overhead(
    runs: Mapping[str, Sequence[tuple[int, str]]], backends: Mapping[str, Mapping[str, float]]
) -> dict[str, float]:
    """Per hop, the median over ``runs`` (run id -> its records, as `spent` takes them) of the
    milliseconds the run spent in that hop less what its backends took there (``backends``:
    hop -> run id -> ms, the model server's and the tool server's own accounts): what each
    stage adds to a run whose calls take time. Runs without an account of each backend hop
    are left out; no figures without runs."""
    per_run: dict[str, list[float]] = {hop: [] for hop in HOPS}
    for run_id, records in runs.items():
        if any(run_id not in backends.get(hop, {}) for hop in EFFECT_HOPS.values()):
            continue
        for hop, ms in spent(records).items():
            per_run[hop].append(ms - backends.get(hop, {}).get(run_id, 0.0))
    return {hop: round(percentile(ms, 0.5), 1) for hop, ms in per_run.items() if ms}
