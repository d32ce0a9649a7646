"""Reading whole records held in memory (a Valkey value, an object) into host rows, for the tiers that get a
record in one piece: verified as the key's record of the namespace before a byte reaches the row."""

from __future__ import annotations

import logging
import threading

from kvoffload.errors import RecordError
from kvoffload.tiers._fileio import copy_bytes
from kvoffload.tiers._record import unpack_record

__all__ = ["RecordReader"]

logger = logging.getLogger(__name__)


class RecordReader:
    """Copies verified payloads of ``namespace``'s records into rows (``secret``: the MAC key, None: unchecked;
    ``what`` names the tier in the one WARNING said when records carry a MAC this process cannot check)."""

    def __init__(self, *, namespace: bytes, secret: bytes | None, what: str) -> None:
        self.namespace = namespace
        self.secret = secret
        self.what = what
        self._warned = False
        self._lock = threading.Lock()

    def into(self, record: memoryview, key: bytes, row: memoryview) -> int | RecordError:
        """Copy the payload of ``record`` into ``row`` once it is verified as ``key``'s: the bytes copied, or the
        :class:`RecordError`."""
        try:
            header, payload = unpack_record(
                record, key=key, payload_len=len(row), namespace=self.namespace, secret=self.secret
            )
        except RecordError as exc:
            return exc
        if self.secret is None and header.authenticated:
            self._note_unchecked_mac()
        copy_bytes(row, payload)
        return len(row)

    def _note_unchecked_mac(self) -> None:
        """One WARNING per reader: its tier's writers authenticate records that this process cannot check."""
        with self._lock:
            if self._warned:
                return
            self._warned = True
        logger.warning(
            "kvoffload: %s holds authenticated records (they carry a MAC) but this process has no %s: their MACs "
            "are not checked; set the writers' secret in its environment",
            self.what,
            "KVOFFLOAD_RECORD_SECRET",
        )
