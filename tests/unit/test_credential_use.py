"""Writing credential uses to Postgres is throttled: each credential's latest use at most once
per interval, whatever the number of requests; a failed write is due again at once; the ids of
credentials no longer held are forgotten. And the store's list shows the later of its own time
and the stored one. (The writes themselves: tests/integration/test_credential_use.py.)"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from agentruns.connectors.api.credential_use import WRITE_EVERY_MS, UseThrottle
from agentruns.connectors.api.credentials import CredentialStore, fixed_credentials, token_digest

TOKEN = "t" * 40


def test_a_hot_credential_is_written_once_per_interval_with_its_latest_use() -> None:
    now = [1_000]
    throttle = UseThrottle(lambda: now[0], every_ms=60_000)
    for at in range(1_000, 1_500):  # many requests before the writer wakes
        throttle.note("ci", at)
    assert throttle.due() == {"ci": 1_499}
    throttle.written(["ci"])
    assert throttle.due() == {}
    for at in range(2_000, 50_000, 7):  # hot: a request every 7 ms for most of a minute
        throttle.note("ci", at)
        now[0] = at
        assert throttle.due() == {}
    now[0] = 1_000 + 60_000
    assert throttle.due() == {"ci": 49_999}
    throttle.written(["ci"])
    now[0] = 200_000
    assert throttle.due() == {}  # nothing used since: nothing to write


def test_credentials_are_throttled_each_on_its_own() -> None:
    now = [0]
    throttle = UseThrottle(lambda: now[0], every_ms=100)
    throttle.note("a", 0)
    assert throttle.due() == {"a": 0}
    throttle.written(["a"])
    now[0] = 50
    throttle.note("a", 50)
    throttle.note("b", 50)  # never written: due at once
    assert throttle.due() == {"b": 50}
    throttle.written(["b"])
    now[0] = 100
    assert throttle.due() == {"a": 50}


def test_a_use_never_moves_back_and_a_failed_write_is_due_again() -> None:
    now = [0]
    throttle = UseThrottle(lambda: now[0], every_ms=100)
    throttle.note("a", 30)
    throttle.note("a", 20)  # an older use noted late (another thread)
    batch = throttle.due()
    assert batch == {"a": 30}
    throttle.note("a", 25)
    throttle.failed(batch)  # Postgres down: the use is kept, due at the next turn
    assert throttle.due() == {"a": 30}
    throttle.written(["a"])
    throttle.note("a", 40)
    assert throttle.due() == {} and throttle.due(every=True) == {"a": 40}  # at a stop: all


def test_credentials_no_longer_held_are_forgotten() -> None:
    throttle = UseThrottle(lambda: 0, every_ms=WRITE_EVERY_MS)
    throttle.note("gone", 1)
    throttle.note("kept", 1)
    throttle.keep(["kept", "new"])
    assert throttle.due() == {"kept": 1}


class _Record:
    """What the store tells `credential_use.CredentialUse`, with a table of stored uses."""

    def __init__(self, stored: dict[str, int]) -> None:
        self.stored = stored
        self.noted: list[tuple[str, int]] = []
        self.held_ids: list[list[str]] = []

    def note(self, credential_id: str, at: int) -> None:
        self.noted.append((credential_id, at))

    def held(self, ids: Iterable[str]) -> None:
        self.held_ids.append(sorted(ids))

    def read(self, ids: Iterable[str]) -> dict[str, int]:
        return {k: v for k, v in self.stored.items() if k in set(ids)}


def test_the_list_shows_the_later_of_this_process_and_the_stored_use(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    path.write_text(f"ci billing read {token_digest(TOKEN)}\n")
    now = [500]
    record = _Record({"ci": 900, "api": 100, "gone": 5})
    store = CredentialStore(fixed_credentials("a" * 32, {}), path, lambda: now[0], uses=record)
    assert record.held_ids == [["api", "ci"]]  # the ids only, never a hash
    assert store.lookup(TOKEN) is not None and store.lookup("a" * 32) is not None
    assert record.noted == [("ci", 500), ("api", 500)]
    listed = {c["id"]: c["last_used_at"] for c in store.described()}
    assert listed == {"ci": 900, "api": 500}  # another process used ci later; api: this one
    record.stored = {}  # Postgres unreadable: this process's times
    assert {c["id"]: c["last_used_at"] for c in store.described()} == {"ci": 500, "api": 500}
