"""Why connections were refused, kept within a bound.

A port scanner, or a misconfigured peer redialing in a loop, makes a role
refuse connections forever; the reasons it keeps must not grow with them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

RECENT_REFUSALS = 256


class Refusals:
    """The last ``keep`` reasons, oldest first, and how many there were in all (``total``)."""

    def __init__(self, keep: int = RECENT_REFUSALS) -> None:
        self._recent: deque[str] = deque(maxlen=keep)
        self.total = 0

    def add(self, reason: str) -> None:
        self._recent.append(reason)
        self.total += 1

    def __iter__(self) -> Iterator[str]:
        return iter(self._recent)

    def __len__(self) -> int:
        return len(self._recent)

    def __getitem__(self, index: int) -> str:
        return self._recent[index]

    def __repr__(self) -> str:
        return f"Refusals(total={self.total}, recent={list(self._recent)!r})"


__all__ = ["RECENT_REFUSALS", "Refusals"]
