"""What one tier instance holds: its records' keys and sizes, least recently written or read first, and the byte
bound that evicts from that end (``max_bytes``; None: unbounded).

Every tier kind keeps one (:class:`~kvoffload.tiers.TierBase` owns it): the records this instance wrote or read,
plus those it found at start (a disk directory's files, an object-store prefix's objects, a Valkey namespace's
keys), older than anything it touches later. Residency is per instance, so the bound of a store that several
engines share covers what each engine knows of it, as the disk tier's bound always did for a shared directory.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvoffload._ints import check_optional_int

__all__ = ["Residency", "index_in_background"]

logger = logging.getLogger(__name__)


class Residency:
    """Keys and record bytes of one tier instance, least recent first, bounded by ``max_bytes`` (thread-safe)."""

    def __init__(self, max_bytes: int | None = None, *, where: str = "") -> None:
        check_optional_int("max_bytes", max_bytes, 1, where=where)
        self.max_bytes = max_bytes
        self._records: OrderedDict[bytes, int] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of the records held."""
        return self._total

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def add(self, key: bytes, size: int) -> None:
        """``key``'s record of ``size`` bytes was written: it becomes the most recent."""
        with self._lock:
            self._total += size - self._records.pop(key, 0)
            self._records[key] = size

    def add_found(self, found: Iterable[tuple[bytes, int]]) -> None:
        """Records found on the medium at start, oldest first: older than every record this instance touched
        since (those keep their place)."""
        with self._lock:
            older = [(k, s) for k, s in found if k not in self._records]
            for key, size in reversed(older):
                self._records[key] = size
                self._records.move_to_end(key, last=False)
                self._total += size

    def note(self, held: Iterable[tuple[bytes, int]], gone: Iterable[bytes] = ()) -> bool:
        """Records ``held`` (key, bytes) were written or read: each becomes the most recent (one not held yet
        joins); those of ``gone`` were found missing. Whether any was held."""
        any_held = False
        for key, size in held:
            any_held = True
            if not self.touch(key):
                self.add(key, size)
        for key in gone:
            self.remove(key)
        return any_held

    def touch(self, key: bytes) -> bool:
        """``key``'s record was read or found again: it becomes the most recent (False: not held)."""
        with self._lock:
            if key not in self._records:
                return False
            self._records.move_to_end(key)
            return True

    def remove(self, key: bytes) -> None:
        """``key``'s record is gone (deleted, found missing); no error if it was not held."""
        with self._lock:
            self._total -= self._records.pop(key, 0)

    def over_limit(self) -> list[bytes]:
        """Take the least recent records out until the rest fits ``max_bytes``: the keys whose records the caller
        must delete from the medium."""
        if self.max_bytes is None or self._total <= self.max_bytes:
            return []
        victims: list[bytes] = []
        with self._lock:
            for key in list(self._records):
                if self._total <= self.max_bytes:
                    break
                self._total -= self._records.pop(key)
                victims.append(key)
        return victims

    def clear(self) -> list[bytes]:
        """Forget every record; the keys that were held."""
        with self._lock:
            keys = list(self._records)
            self._records.clear()
            self._total = 0
        return keys


def index_in_background(
    residency: Residency,
    listing: Callable[[], Iterable[tuple[bytes, int]]],
    *,
    then: Callable[[], None],
    what: str,
    name: str,
) -> threading.Event:
    """Take the records a medium already holds (``listing``: keys and record bytes, oldest first) into
    ``residency`` on a thread of its own, so a big store does not hold the engine's start, then call ``then`` (the
    bound). A listing that fails leaves residency to what the tier writes and reads (one INFO line naming
    ``what``). The event is set when it is over."""
    done = threading.Event()

    def run() -> None:
        try:
            residency.add_found(list(listing()))
            then()
        except Exception as exc:
            logger.info(
                "kvoffload: %s could not list the records it already holds (%s: %s): its residency and max_bytes "
                "count the records it writes and reads from now on",
                what,
                type(exc).__name__,
                exc,
            )
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    return done
