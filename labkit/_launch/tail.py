"""Follow a growing text file line by line (rank logs, metrics files)."""

from __future__ import annotations

import json
import os


class LineTail:
    """Hands out the complete lines appended to ``path`` since the last call.

    A line still being written (no newline yet) is held back until it is
    complete; ``rest()`` returns it at the end. The file may not exist yet.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._offset = 0
        self._partial = b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:
                    # Written again from the start: torchrun reuses an attempt's log file when
                    # an elastic run's workers restart because a node joined (same restart count).
                    self._offset, self._partial = 0, b""
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        if not chunk:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        return [line.decode("utf-8", errors="replace").rstrip("\r") for line in complete]

    def rest(self) -> str:
        """The unfinished last line, if any (and forget it)."""
        text = self._partial.decode("utf-8", errors="replace")
        self._partial = b""
        return text


def parse_records(lines: list[str]) -> tuple[list[dict], int]:
    """JSON records from metrics lines; a torn or garbled line is skipped and counted."""
    records, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict) and "step" in record and "rank" in record:
            records.append(record)
        else:
            skipped += 1
    return records, skipped
