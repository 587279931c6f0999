"""The length log: one JSON line per answered input, safe to keep (no text, ever).

Fields: `id` (anonymous), `arrival` (unix seconds), `length` (tokens), `bucket` (label),
`queue_wait_ms`, `exec_ms`, `status`. `lenbatch analyze` and `lenbatch fit` read this file, which
closes the loop: serve, log lengths, re-fit the boundaries from real traffic.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import IO

__all__ = ["LengthLog"]


class LengthLog:
    """Append-only JSONL writer; line-buffered so a crash loses at most one line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def write(
        self,
        *,
        id: str,
        arrival: float,
        length: int,
        bucket: str,
        queue_wait_ms: float | None,
        exec_ms: float | None,
        status: str,
    ) -> None:
        """Append one record."""
        line = json.dumps(
            {
                "id": id,
                "arrival": round(arrival, 6),
                "length": length,
                "bucket": bucket,
                "queue_wait_ms": None if queue_wait_ms is None else round(queue_wait_ms, 3),
                "exec_ms": None if exec_ms is None else round(exec_ms, 3),
                "status": status,
            }
        )
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        """Flush and close the file."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
