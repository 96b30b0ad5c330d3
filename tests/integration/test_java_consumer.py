"""A consumer in another language: examples/java/ResultsReader.java, with the Avro and Kafka
jars from Maven Central, derives the same run ids and partitions and reads the results topic
as it is (docs/contract.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from agentruns.connectors.json_schemas import DIRECTORY
from agentruns.processors.ids import run_id_for_key
from agentruns.streams.partitioning import partition_for
from agentruns.streams.topics import RESULTS, topic_name
from tests.support.api import PARTITIONS, Stack

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "java"


@pytest.fixture(scope="module")
def java(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The command that runs the example, its jars resolved by Maven."""
    lib = tmp_path_factory.mktemp("java-lib")
    mvn, java = shutil.which("mvn"), shutil.which("java")
    assert mvn and java, "the Java example needs java (17+) and mvn on PATH"
    subprocess.run(
        [mvn, "-B", "-q", "-f", str(EXAMPLE / "pom.xml"), "dependency:copy-dependencies",
         f"-DoutputDirectory={lib}", "-DincludeScope=runtime"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return [java, "-cp", f"{lib}/*", str(EXAMPLE / "ResultsReader.java")]


def run(command: list[str], timeout: float = 120) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_java_derives_the_same_run_ids_and_partitions(java: list[str]) -> None:
    # refund-7's run hashes to a negative murmur2: toPositive, not abs, decides its partition
    keys = ["order-42", "refund-7", "refund-8", "a", "key with spaces:and:colons"]
    for partitions in (1, 6, 7):
        out = run([*java, "run-id", str(partitions), *keys]).splitlines()
        expected = [f"{r}\t{partition_for(r, partitions)}" for r in map(run_id_for_key, keys)]
        assert out == expected, partitions


def test_java_reads_a_committed_result_with_binary_message_decoder(
    java: list[str], stack: Stack
) -> None:
    run_id = stack.submit(f"java-{uuid.uuid4().hex}")
    stack.wait_status(run_id, "SUCCEEDED")
    topic = topic_name(RESULTS, stack.prefix)
    out = run([*java, "results", stack.bootstrap, topic, str(ROOT / "schemas"), run_id, "60"])
    lines = [line.split("\t") for line in out.splitlines()]
    assert len(lines) == 1, out
    partition, hashed, found, status, _summary, body = lines[0]
    assert int(partition) == int(hashed) == partition_for(run_id, PARTITIONS)
    assert (found, status) == (run_id, "SUCCEEDED")
    result = json.loads(body)
    schema = json.loads((DIRECTORY / "result.schema.json").read_text(encoding="utf-8"))
    Draft202012Validator(schema).validate(result)
    assert result["run_id"] == run_id
