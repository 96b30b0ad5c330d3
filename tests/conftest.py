"""Fixtures shared by the whole test run: one real Kafka broker and one real Postgres.

Resolved by the development harness (agentruns.connectors.dev.stack.services):
KAFKA_BOOTSTRAP_SERVERS / DATABASE_URL if set, testcontainers when Docker answers, else local
processes started in a temporary directory on free ports
and stopped at the end. Fixtures are lazy: unit tests never start anything.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentruns.connectors.dev.stack.services import ServiceStack
from agentruns.connectors.endpoints import Endpoints

#: Tests that start brokers of their own, cut the network or kill processes at random: with
#: `pytest -n 2` (`make test`) they run one after another on one worker, so that no two of them
#: share the machine's two cores while the other tests, mostly waiting on the broker, run beside.
HEAVY = {
    "tests/e2e/test_chaos.py",
    "tests/e2e/test_chaos_cluster.py",
    "tests/e2e/test_executor_kills.py",
    "tests/e2e/test_hostile.py",
    "tests/integration/test_cluster_faults.py",
    "tests/integration/test_full_disk.py",
    "tests/integration/test_network_partition.py",
    "tests/integration/test_tool_executor.py::"
    "test_a_second_executor_joining_mid_stream_executes_nothing_twice",
}
#: Files or single tests (``path::name``, every parameter) marked `slow`: the heavy ones, those
#: that start a broker, a JVM, a browser or the whole stack of their own, and those taking more
#: than about 10 s each (`--durations`), so that `make check`, which leaves them out
#: (`-m "not slow"`), stays within about 5 minutes on two cores; `make test` runs them.
SLOW = HEAVY | {
    "tests/e2e/test_monolith.py",
    "tests/e2e/test_phoenix_traces.py",
    "tests/e2e/test_quickstart.py",
    "tests/e2e/test_sasl.py",
    "tests/integration/test_bench_restore.py",
    "tests/integration/test_console_browser.py",
    "tests/integration/test_faust.py",
    "tests/integration/test_health_endpoints.py",
    "tests/integration/test_java_consumer.py",
    "tests/integration/test_kafka_acls.py",
    "tests/integration/test_versions.py",
    "tests/integration/test_calls_in_flight.py::"
    "test_a_call_longer_than_the_poll_interval_keeps_the_executor_in_its_group",
    "tests/integration/test_mcp_tasks.py::"
    "test_the_executor_killed_while_the_task_runs_completes_the_run_once",
    "tests/integration/test_calls_in_flight.py::"
    "test_a_rebalance_with_calls_in_flight_answers_each_effect_once",
    "tests/integration/test_cli_dev.py::test_a_command_leaves_running_what_another_command_started",
    "tests/integration/test_cli_dev.py::test_dev_up_status_down_leaves_nothing_behind",
    "tests/integration/test_cli_dev.py::test_unreachable_bootstrap_is_one_clear_line",
    "tests/integration/test_cli_errors.py::"
    "test_a_broker_that_does_not_answer_is_one_line_in_bounded_time",
    "tests/integration/test_cli_errors.py::"
    "test_client_commands_use_the_local_stack_another_command_started",
    "tests/integration/test_cli_operator.py::test_the_operator_commands_failures_are_one_line",
    "tests/integration/test_idle_fetch.py::test_idle_executor_and_sink_poll_rarely",
    "tests/integration/test_mcp_tools.py::test_kill_9_of_the_executor_mid_calls_executes_no_key_twice",
    "tests/integration/test_processor.py::test_out_of_order_duplicates_conflicts_and_gap_timeout",
    "tests/integration/test_processor_hostile.py::"
    "test_an_ended_run_is_held_as_its_snapshot_and_answered_late_across_a_restart",
    "tests/integration/test_calls_in_flight.py::"
    "test_an_instant_run_ends_while_slow_runs_are_still_in_their_first_call",
    "tests/integration/test_kafka_logs.py::test_clients_at_a_dead_port_log_a_few_lines_not_hundreds",
    "tests/integration/test_processor.py::test_a_failed_transaction_drops_the_batch_applied_behind_it",
    "tests/integration/test_processor.py::test_a_killed_member_is_replaced_by_the_other",
    "tests/integration/test_processor.py::"
    "test_a_paused_member_comes_back_as_a_zombie_and_commits_nothing_twice",
    "tests/integration/test_processor.py::test_kill_9_at_random_points_loses_and_repeats_nothing",
    "tests/integration/test_processor_hostile.py::"
    "test_a_batch_the_broker_keeps_refusing_is_isolated_and_its_poison_dead_lettered",
    "tests/integration/test_processor_hostile.py::"
    "test_an_evicted_run_stays_ended_across_restarts_whatever_its_resubmissions_say",
    "tests/integration/test_resubmission.py::"
    "test_a_key_never_starts_its_run_twice_however_it_arrives_after_a_restart",
    "tests/integration/test_tool_executor.py::"
    "test_a_second_executor_joining_mid_stream_executes_nothing_twice",
    "tests/integration/test_tool_executor.py::test_kill_9_mid_batch_and_restart_executes_no_key_twice",
}


def _listed(item: pytest.Item, listing: set[str]) -> bool:
    path, _, name = item.nodeid.partition("::")
    return path in listing or f"{path}::{name.split('[', 1)[0]}" in listing


# Before the `-m` selection, which reads the markers added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _listed(item, SLOW):
            item.add_marker(pytest.mark.slow)
        if _listed(item, HEAVY):
            item.add_marker(pytest.mark.xdist_group("heavy"))


@pytest.fixture(scope="session", autouse=True)
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The processors the tests start keep their stores of ended runs here, not in the user's
    state directory (the processes they start inherit it)."""
    path = tmp_path_factory.mktemp("state")
    os.environ["AGENTRUNS_STORE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def services() -> Iterator[Endpoints]:
    with ServiceStack(ephemeral=True) as stack:
        assert stack.endpoints is not None
        yield stack.endpoints


@pytest.fixture(scope="session")
def kafka_bootstrap(services: Endpoints) -> str:
    return services.kafka_bootstrap


@pytest.fixture(scope="session")
def database_url(services: Endpoints) -> str:
    from agentruns.connectors.postgres.migrate import migrate

    migrate(services.database_url)
    return services.database_url


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A topic/group/prefix name no other test uses (tests share one broker)."""
    base = request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:40]
    return f"t-{base}-{uuid.uuid4().hex[:8]}"
