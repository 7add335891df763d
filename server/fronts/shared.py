"""Limits counted over every front process, so each holds server-wide as with one process.

``--max-rpcs``, ``--max-streams`` and ``--max-queue`` bound what the whole server holds,
whichever front a connection landed on.  :class:`SharedCounts` keeps one row per front
in a small file of the private directory, mapped by every front: a front changes only its
own row, and admits one more only if the sum over the rows stays within the limit, the
check and the increment under an exclusive ``flock`` of the file (a give-back needs none).  The kernel drops a dead process's ``flock``, so
no lock outlives its holder, and the first front clears the row of a front that died
(its calls went with it).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
from pathlib import Path
from typing import Iterator

#: The counts, one column each: calls admitted (max_rpcs), streams open
#: (max_streams), and calls with a request at the learner process (max_queue).
COLUMNS = ("rpcs", "streams", "queue")
_CELL = 8   # bytes: a signed 64-bit count


class SharedCounts:
    """The counts of ``fronts`` front processes in the file at ``path`` (made by the
    first front, ``create``), as front ``index`` sees and changes them."""

    def __init__(self, path: Path, fronts: int, index: int, *, create: bool = False):
        self.index, self._fronts = index, fronts
        size = fronts * len(COLUMNS) * _CELL
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        self._fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._cells = memoryview(self._map).cast("q")   # [fronts × columns]
        self._lock = threading.Lock()   # flock is per open file, shared by this process's threads
        self._closed = False

    def tally(self, column: str, limit: int) -> "SharedTally":
        """The :class:`~duelq.server.gate.Tally` of ``column`` up to ``limit``."""
        return SharedTally(self, COLUMNS.index(column), limit)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The counts to themselves: this process's threads, then the other fronts."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _sum(self, column: int) -> int:
        width = len(COLUMNS)
        return sum(self._cells[f * width + column] for f in range(self._fronts))

    def _take(self, column: int, limit: int) -> bool:
        """Add one to this front's ``column`` unless the server-wide sum is at ``limit`` (or
        the counts are closed: the front has stopped).  The check and the increment hold the
        file's ``flock``, so two fronts cannot both take the last place."""
        with self._lock:
            if self._closed:
                return False
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                if self._sum(column) >= limit:
                    return False
                self._cells[self.index * len(COLUMNS) + column] += 1
                return True
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _give_back(self, column: int) -> None:
        """Take one off this front's ``column``.  No ``flock``: only this process writes its
        row (its threads under ``_lock``), and an aligned 8-byte store is seen whole by the
        others; a front summing meanwhile sees the count before or after, as if the
        give-back came just after or before its check (a decrement never lets a take pass
        the limit)."""
        with self._lock:
            if not self._closed:
                self._cells[self.index * len(COLUMNS) + column] -= 1

    def total(self, column: str) -> int:
        """The server-wide count of ``column``."""
        with self._locked():
            return self._sum(COLUMNS.index(column))

    def clear(self, index: int) -> None:
        """Zero front ``index``'s row: it died, and its calls with it."""
        with self._locked():
            for column in range(len(COLUMNS)):
                self._cells[index * len(COLUMNS) + column] = 0

    def close(self) -> None:
        with self._lock:   # its file closes: no flock to give back after
            self._closed = True
            self._cells.release()
            self._map.close()
            os.close(self._fd)


class SharedTally:
    """One column of :class:`SharedCounts` as a :class:`~duelq.server.gate.Tally`."""

    def __init__(self, counts: SharedCounts, column: int, limit: int):
        self._counts, self._column, self.limit = counts, column, limit

    def take(self) -> bool:
        return self._counts._take(self._column, self.limit)

    def give_back(self) -> None:
        self._counts._give_back(self._column)
