"""A sweep split over processes or machines: ``--shard K/N`` answers the K-th of N shares of the samples.

Each task's samples go round the shards by index, the task's rank offsetting the start (sample i of the j-th task
to shard (i + j) mod N), so every shard gets every task evenly (within one sample), whatever N and the number of
tasks, and keeps the sweep's order (index-major for RULER and facts). Each shard writes its own folder;
``criticalkv report A B ... --out C`` merges them (``eval.merge``). The shard is not a setting of the sweep: the
shards' folders record the same settings, which is what lets them merge.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, TypeVar

from criticalkv.errors import CriticalKVError


class Keyed(Protocol):  # what a sweep's sample has (its row's key)
    task: str
    index: int


T = TypeVar("T", bound=Keyed)

SHARD_HELP = (
    "K/N: answer the K-th of N shares of the samples (1 <= K <= N; each task's samples evenly), to split a sweep "
    "over N processes or machines; each shard writes its own folder (by default the sweep's, ending in "
    "-shardKofN), and `criticalkv report A B ... --out C` merges them."
)


@dataclass(frozen=True)
class Shard:
    index: int  # K, from 1
    count: int  # N

    @classmethod
    def parse(cls, text: str | None) -> Shard | None:
        """``"2/3"`` -> Shard(2, 3); None or ``""`` -> None (the whole sweep)."""
        if not text:
            return None
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if match is None:
            raise CriticalKVError(f"--shard takes K/N, e.g. 1/2, got {text!r}")
        index, count = int(match[1]), int(match[2])
        if not 1 <= index <= count:
            raise CriticalKVError(f"--shard {text}: K must be between 1 and N")
        return cls(index, count)

    def take(self, samples: list[T]) -> list[T]:
        """This shard's samples, in their order: sample i of the j-th task (by first appearance) when
        (i + j) mod N = K - 1."""
        ranks: dict[str, int] = {}
        for sample in samples:
            ranks.setdefault(sample.task, len(ranks))
        return [s for s in samples if (s.index + ranks[s.task]) % self.count == self.index - 1]

    @property
    def folder_suffix(self) -> str:
        return f"-shard{self.index}of{self.count}"
