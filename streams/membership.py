"""What a consumer's rebalance callbacks said last, for threads that must not ask the consumer.

Other threads (the health probe) read it here: the consumer's own calls (``assignment()``,
``memberid()``) wait while a rebalance is in progress, which is when a probe asks most.
"""

from __future__ import annotations

from collections.abc import Sized


class Membership:
    """Updated from the consumer's ``on_assign``/``on_revoke``/``on_lost`` callbacks."""

    def __init__(self) -> None:
        # (an assignment arrived since the last revocation, partitions in it): one attribute,
        # replaced whole, so a reader never sees half an update
        self.state: tuple[bool, int] = (False, 0)
        # partition -> why its processing stopped (the processor's stopped partitions)
        self.stopped_partitions: dict[int, str] = {}

    def assigned(self, partitions: Sized) -> None:
        self.state = (True, len(partitions))

    def revoked(self) -> None:
        self.state = (False, 0)

    def stopped(self, partitions: dict[int, str]) -> None:
        self.stopped_partitions = dict(partitions)
