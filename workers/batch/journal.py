"""A batch's results so far: two append-only files in the file store's directory, the parts
of its future output and error files (`{file_id}.part`, published by FileStore.add when the
batch ends). The files are the truth about which lines finished: a run that starts over
(its jobs worker died) reads them back, cuts a line torn by the crash, and skips every
custom_id they hold, so no line is written twice. Each line is flushed to the OS as it is
written: a killed process loses nothing it wrote."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import IO

from shared.batch_lines import custom_id_of


def result_file_ids(batch_id: str) -> tuple[str, str]:
    """The output and error file ids of a batch (fixed, so a rerun finds its parts)."""
    digest = hashlib.sha256(batch_id.encode()).hexdigest()
    return f"file-{digest[:24]}", f"file-{digest[24:48]}"


class Journal:
    def __init__(self, output_part: Path, error_part: Path) -> None:
        self.paths = {True: output_part, False: error_part}
        self.files: dict[bool, IO[bytes]] = {}
        self.counts = {True: 0, False: 0}  # lines written: ok, failed
        self.done: set[str] = set()

    def open(self) -> None:
        """Read back what an earlier run wrote, then open both parts for appending."""
        for ok, path in self.paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            ids = _recover(path)
            self.done.update(ids)
            self.counts[ok] = len(ids)
            self.files[ok] = open(path, "ab")  # noqa: SIM115 (closed by close())

    def write(self, custom_id: str, line: bytes, ok: bool) -> None:
        f = self.files[ok]
        f.write(line)
        f.flush()
        self.done.add(custom_id)
        self.counts[ok] += 1

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


def _recover(path: Path) -> list[str]:
    """The custom_ids of the whole lines of `path`; a torn last line is cut off."""
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    ids = (custom_id_of(line) for line in whole.splitlines())
    return [i for i in ids if i is not None]
