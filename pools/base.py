"""The experience-pool contract that producers and the learner program against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import pyarrow as pa

from streamrl.core.types import Admission, Batch, ConsumptionPolicy, Ledger, SampleGroup


class PoolError(Exception):
    """The pool cannot be opened or used; the message says what to check."""


class NoPool(PoolError):
    """Opened without create: no pool at that URI (yet), as opposed to one that is there but unusable."""


class ExperiencePool(Protocol):
    uri: str

    def admit(self, admissions: Sequence[Admission]) -> None:
        """Record prompt instances as admitted (in flight). Durable on return."""

    def append(self, groups: Sequence[SampleGroup]) -> None:
        """Store finished groups (complete, dropped or failed); replaces a stored partial of the
        same group atomically. Durable on return; concurrent calls share one commit."""

    def save_partial(self, groups: Sequence[SampleGroup]) -> None:
        """Store in-flight groups with status `partial`, replacing an earlier partial of each."""

    def partial_groups(self, producer_id: str | None = None) -> list[SampleGroup]:
        """Stored partial groups, to resume after an interruption."""

    def claim(
        self,
        step: int,
        learner_version: int,
        num_groups: int,
        max_staleness: int,
        policy: ConsumptionPolicy = "drop",
    ) -> Batch | None:
        """Claim the oldest `num_groups` complete groups for learner `step`, applying the
        consumption policy to groups over the staleness bound. None if too few are ready."""

    def ledger(self) -> Ledger: ...

    def compact(self) -> None: ...

    def scan(self, columns: list[str] | None = None, where: str | None = None) -> pa.Table: ...

    def close(self) -> None: ...
