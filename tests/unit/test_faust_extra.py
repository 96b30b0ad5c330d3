"""The Faust extra without a broker: its codecs as Faust finds them (the `faust.codecs` entry
point), its topics under the prefix, and agentruns without faust installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from faust.serializers import codecs

from agentruns.connectors.api.client import task_input
from agentruns.connectors.api.inputs import MAX_RECORD_BYTES, InvalidInputError
from agentruns.connectors.faust import INPUT_CODEC, RESULT_CODEC, app, inbox_topic, results_topic
from agentruns.streams.codec import WrongRecordTypeError, decode, encode

RESULT = {
    "run_id": "run-afc2e0f17bac52aabaa3475862e80808",
    "status": "SUCCEEDED",
    "seq": 7,
    "version": 0,
    "result_ref": "sha256:ab",
    "summary": "done",
    "trace_id": "6317c21e1d505922ba877b56888b4037",
    "at": 1767225600000,
    "body": '{"status":"SUCCEEDED"}',
}


def test_faust_finds_the_codecs_by_their_entry_point_names() -> None:
    _, record = task_input(
        {"goal": "Tell the customer of order 42 when it ships."},
        idempotency_key="order-42",
        producer_id="faust-example",
        at=1767225600000,
    )
    wire = codecs.dumps(INPUT_CODEC, record)
    assert wire == encode("Input", record)  # the single-object encoding, current version
    assert wire[:10] == bytes.fromhex("c3012171e3257f4f6b3e")
    assert codecs.loads(INPUT_CODEC, wire) == decode(wire, "Input").record
    result = codecs.dumps(RESULT_CODEC, RESULT)
    assert codecs.loads(RESULT_CODEC, result) == RESULT


def test_a_codec_refuses_another_record_and_an_outsized_input() -> None:
    with pytest.raises(WrongRecordTypeError):
        codecs.loads(INPUT_CODEC, encode("Result", RESULT))
    _, record = task_input({"goal": "g"}, idempotency_key="big", producer_id="faust-example")
    with pytest.raises(InvalidInputError, match="invalid_input"):
        codecs.dumps(INPUT_CODEC, {**record, "body": "x" * MAX_RECORD_BYTES})


def test_topics_take_the_prefix_and_the_app_reads_read_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    faust_app = app("unit-faust", "127.0.0.1:9")
    assert faust_app.conf.processing_guarantee.value == "exactly_once"
    assert inbox_topic(faust_app, "acme").get_topic_name() == "acme.inbox"
    assert results_topic(faust_app, "acme").get_topic_name() == "acme.results"
    monkeypatch.setenv("AGENTRUNS_TOPIC_PREFIX", "env-prefix")
    assert results_topic(faust_app).get_topic_name() == "env-prefix.results"
    with pytest.raises(ValueError, match="exactly_once"):
        app("unit-faust", "127.0.0.1:9", processing_guarantee="at_least_once")


def test_agentruns_imports_without_faust_and_the_faust_module_says_what_is_missing() -> None:
    # `faust` is made unimportable in a fresh interpreter, as where the extra is not installed.
    code = (
        "import sys; sys.modules['faust'] = None\n"
        "import agentruns.connectors.api.client, agentruns.connectors.cli\n"
        "import agentruns.connectors.faust\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: agentruns.connectors.faust needs faust-streaming:"
        " pip install 'agentruns[faust]'"
    )
