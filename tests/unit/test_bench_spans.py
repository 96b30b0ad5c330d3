"""`agentruns bench spans`: both paths make and export every span, both encoders write the
same request, and the figures compare medians."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agentruns.bench import spans
from agentruns.streams import otlp_encoding


def test_both_encoders_write_the_same_request_for_the_bench_spans() -> None:
    batch = spans.readable_spans(20)
    assert len(batch) == 40
    assert len({s.context.span_id for s in batch}) == 40
    ours = ExportTraceServiceRequest.FromString(otlp_encoding.encode(batch))
    assert ours == encode_spans(batch)


def test_compare_gives_medians_and_the_ratio_of_agentruns_to_the_sdk() -> None:
    figures = spans.compare({"agentruns": [10.0, 12.0, 30.0], "sdk": [40.0, 48.0, 44.0]})
    assert figures["agentruns"] == {"median": 12.0, "min": 10.0, "max": 30.0}
    assert figures["sdk"]["median"] == 44.0
    assert figures["agentruns_over_sdk"] == round(12.0 / 44.0, 3)
    assert spans.compare({"agentruns": [1.0], "sdk": [0.0]})["agentruns_over_sdk"] is None


def test_a_short_run_exports_every_span_of_both_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "spans.json"
    assert spans.main(["--spans", "100", "--rounds", "1", "--out", str(out)]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures == json.loads(out.read_text())
    assert figures["spans_per_round"] == 200
    for key in ("made_and_exported_us_per_span", "encoded_us_per_span"):
        for path in spans.PATHS:
            assert figures[key][path]["median"] > 0
    # each child's warm-up and round reached the receiver: nothing was dropped unseen
    assert figures["otlp_exported"]["export_requests"] >= 2
    assert figures["otlp_exported"]["export_bytes"] > 2 * 200 * 100


def test_rounds_and_spans_below_one_are_refused() -> None:
    with pytest.raises(SystemExit):
        spans.main(["--rounds", "0"])
