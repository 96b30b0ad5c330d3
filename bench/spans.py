"""`agentruns bench spans`: what one recorded span costs a process, on agentruns' tracing path
against the OpenTelemetry SDK's own, and the OTLP encoding alone against the exporter's.

Each round starts two child processes, one per path, in alternating order, each exporting over
OTLP/HTTP to a receiver in this process that keeps nothing (`agentruns.bench.otlp_sink`):

- ``agentruns``: `tracing.configure_from_env` as every component runs it (recorded spans
  queued as they are, encoded by `agentruns.streams.otlp_encoding`), spans made with
  `tracing.start`;
- ``sdk``: the SDK's TracerProvider, BatchSpanProcessor and OTLP/HTTP exporter, spans made with
  its tracer.

A child makes ``--spans`` pairs of the spans a pipeline step makes most: a CONSUMER span of
nine attributes linked to its producer (the processor's and the executors' ``process``) and a
CLIENT span of five (an HTTP call), each the child of a sampled remote parent, then waits for
the export queue to drain, and reports its own CPU (user + system, the export thread
included) per span made. Then, in this process, the encoding alone: the same kinds of spans as
the SDK's ReadableSpans, written by `otlp_encoding.encode` and by the exporter's
``encode_spans`` (+ ``SerializeToString``), rounds alternating.

Figures: per path the median microseconds per span over the rounds with min and max, and
agentruns' over the SDK's (below 1: cheaper); beside them the machine's steal, busy cores and
`host_speed` over the child rounds. One JSON object on the last line, also written
to bench/results/spans.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentruns.bench.core import host_speed
from agentruns.bench.machine import MachineCpu
from agentruns.bench.otlp_sink import OtlpSink
from agentruns.bench.results_file import report

PATHS = ("agentruns", "sdk")
PARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
WARMUP_SPANS = 1000
GROUP = "agentruns-processor"


def consumer_attributes(i: int) -> dict[str, Any]:
    """The nine attributes of a processed record's span, as a step's vary them."""
    return {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.destination.name": "agentruns.inbox",
        "messaging.destination.partition.id": str(i % 6),
        "messaging.consumer.group.name": GROUP,
        "messaging.kafka.offset": 100_000 + i,
        "gen_ai.conversation.id": f"run-{i % 500}",
        "agentruns.seq": i % 12,
        "agentruns.event": "ModelCallCompleted",
    }


CLIENT_ATTRIBUTES: dict[str, Any] = {
    "http.request.method": "POST",
    "server.address": "127.0.0.1",
    "server.port": 8080,
    "url.full": "http://127.0.0.1:8080/v1/chat/completions",
    "http.response.status_code": 200,
}


def _agentruns_maker() -> tuple[Callable[[int], None], Callable[[], bool]]:
    from agentruns.streams import tracing

    if not tracing.configure_from_env("bench"):
        raise SystemExit("tracing did not turn on: is the OTLP export installed?")

    def make(i: int) -> None:
        span = tracing.start(
            "process ModelCallCompleted",
            PARENT,
            consumer_attributes(i),
            kind="CONSUMER",
            links=[PARENT],
        )
        span.set_attribute("agentruns.status", "running")
        span.end()
        tracing.start("POST", PARENT, CLIENT_ATTRIBUTES, kind="CLIENT").end()

    return make, tracing.flush


def _sdk_maker() -> tuple[Callable[[int], None], Callable[[], bool]]:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "agentruns-bench"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    tracer = provider.get_tracer("agentruns")
    _, trace_id, span_id, _ = PARENT.split("-")
    remote = trace.SpanContext(
        int(trace_id, 16), int(span_id, 16), True, trace.TraceFlags(trace.TraceFlags.SAMPLED)
    )
    parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    link = [trace.Link(remote)]

    def make(i: int) -> None:
        span = tracer.start_span(
            "process ModelCallCompleted",
            parent,
            trace.SpanKind.CONSUMER,
            consumer_attributes(i),
            link,
        )
        span.set_attribute("agentruns.status", "running")
        span.end()
        tracer.start_span("POST", parent, trace.SpanKind.CLIENT, CLIENT_ATTRIBUTES).end()

    return make, lambda: provider.force_flush(30_000)


def child_main(path: str, pairs: int) -> int:
    """One path's round: warm up, then make ``pairs`` pairs of spans and export them all (a
    queue that does not drain fails the round: its spans' cost would go uncounted)."""
    make, flush = _agentruns_maker() if path == "agentruns" else _sdk_maker()
    for i in range(WARMUP_SPANS // 2):
        make(i)
    if not flush():
        sys.exit("the warm-up's spans were not exported within 30 s")
    began = time.process_time()
    for i in range(pairs):
        make(i)
    if not flush():
        sys.exit("the round's spans were not exported within 30 s")
    print(json.dumps({"us_per_span": round(1e6 * (time.process_time() - began) / (2 * pairs), 2)}))
    return 0


def _round(path: str, url: str, pairs: int) -> float:
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": url,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url + "/v1/traces",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        # room for every span of the round: a dropped span would cost nothing to encode
        "OTEL_BSP_MAX_QUEUE_SIZE": str(4 * pairs + WARMUP_SPANS),
    }
    command = [sys.executable, "-m", "agentruns.bench.spans", "--child", path]
    done = subprocess.run(
        [*command, "--spans", str(pairs)], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {path} child failed: {done.stderr.strip()[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["us_per_span"])


def readable_spans(pairs: int) -> list[Any]:
    """The two kinds of spans as the SDK's ended ReadableSpans (the encoders' input)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

    resource_ = Resource.create({"service.name": "agentruns-bench"})
    scope = InstrumentationScope("agentruns")
    trace_id = int("ab" * 16, 16)
    remote = SpanContext(trace_id, int("cd" * 8, 16), True, TraceFlags(1))
    out: list[Any] = []
    for i in range(pairs):
        for name, kind, attributes, links in (
            ("process ModelCallCompleted", SpanKind.CONSUMER, consumer_attributes(i), [remote]),
            ("POST", SpanKind.CLIENT, dict(CLIENT_ATTRIBUTES), []),
        ):
            out.append(
                ReadableSpan(
                    name=name,
                    context=SpanContext(trace_id, 2 * i + len(out) % 2 + 1, False, TraceFlags(1)),
                    parent=remote,
                    resource=resource_,
                    attributes=attributes,
                    links=[Link(context) for context in links],
                    kind=kind,
                    start_time=1_700_000_000_000_000_000 + i,
                    end_time=1_700_000_000_001_000_000 + i,
                    instrumentation_scope=scope,
                )
            )
    return out


def encoding_rounds(pairs: int, rounds: int, batch: int = 512) -> dict[str, list[float]]:
    """Microseconds per span of each encoder over the same spans, in batches as the batch
    processor hands them over; rounds alternate which goes first."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from agentruns.streams import otlp_encoding

    spans = readable_spans(pairs)
    batches = [spans[i : i + batch] for i in range(0, len(spans), batch)]
    encoders: dict[str, Callable[[Sequence[Any]], bytes]] = {
        "agentruns": otlp_encoding.encode,
        "sdk": lambda b: encode_spans(b).SerializeToString(),
    }
    out: dict[str, list[float]] = {name: [] for name in encoders}
    for r in range(rounds):
        for name in PATHS if r % 2 == 0 else PATHS[::-1]:
            began = time.process_time()
            for each in batches:
                encoders[name](each)
            out[name].append(round(1e6 * (time.process_time() - began) / len(spans), 2))
    return out


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def compare(by_path: dict[str, list[float]]) -> dict[str, Any]:
    """Each path's median (min, max) and agentruns' median over the SDK's."""
    out: dict[str, Any] = {path: summary(by_path[path]) for path in PATHS}
    sdk = out["sdk"]["median"]
    out["agentruns_over_sdk"] = round(out["agentruns"]["median"] / sdk, 3) if sdk else None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns bench spans", description=__doc__)
    parser.add_argument("--spans", type=int, default=5000, help="pairs of spans per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (each path once a round)")
    parser.add_argument("--out", default="bench/results/spans.json")
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.spans < 1 or args.rounds < 1:
        parser.error("--spans and --rounds must be at least 1")
    if args.child:
        return child_main(args.child, args.spans)
    speed = host_speed()
    made: dict[str, list[float]] = {path: [] for path in PATHS}
    cpu = MachineCpu.start()
    with OtlpSink() as sink:
        for r in range(args.rounds):
            for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                made[path].append(_round(path, sink.url, args.spans))
                print(f"round {r + 1}: {path} {made[path][-1]} µs a span", file=sys.stderr)
        exported = sink.counts()
    machine = cpu.stop()
    figures = {
        "bench": "spans",
        "spans_per_round": 2 * args.spans,
        "rounds": args.rounds,
        "made_and_exported_us_per_span": compare(made),
        "encoded_us_per_span": compare(encoding_rounds(args.spans, 2 * args.rounds)),
        "otlp_exported": exported,
        "steal_pct": machine.get("steal_pct"),
        "busy_cores": machine.get("busy_cores"),
        "host_speed": speed,
    }
    report(figures, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
