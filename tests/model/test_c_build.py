"""Built C kernels kept between starts (kernels/c_build.py): a second start loads the kept
library instead of compiling it, and a changed input builds another."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.scheduler.kernels import c_build

SOURCE = c_build.SOURCES / "rms_norm.c"
needs_compiler = pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """The compiler's build commands from now on (its --version queries left out)."""
    commands: list[list[str]] = []
    run = subprocess.run

    def recording(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if "--version" not in command:
            commands.append(command)
        return run(command, **kwargs)

    monkeypatch.setattr(c_build.subprocess, "run", recording)
    yield commands
    c_build.keep_builds_in(None)


@needs_compiler
def test_a_kept_build_is_loaded_instead_of_built_again(
    tmp_path: Path, compiles: list[list[str]]
) -> None:
    c_build.keep_builds_in(tmp_path)
    first = c_build.build_library(SOURCE)
    assert first is not None and len(compiles) == 2  # compiled and linked
    (kept,) = tmp_path.glob("rms_norm-*.so")
    second = c_build.build_library(SOURCE)
    assert second is not None and len(compiles) == 2  # loaded, not built
    assert second._name == str(kept)
    c_build.build_library(SOURCE, ("-DANOTHER_BUILD",))  # other flags: another build
    assert len(compiles) == 4 and len(list(tmp_path.glob("rms_norm-*.so"))) == 2


@needs_compiler
def test_a_broken_kept_build_is_built_again(tmp_path: Path, compiles: list[list[str]]) -> None:
    c_build.keep_builds_in(tmp_path)
    assert c_build.build_library(SOURCE) is not None
    (kept,) = tmp_path.glob("rms_norm-*.so")
    kept.write_bytes(b"not a library")
    assert c_build.build_library(SOURCE) is not None
    assert len(compiles) == 4 and kept.read_bytes().startswith(b"\x7fELF")


@needs_compiler
def test_without_a_folder_every_call_builds(compiles: list[list[str]]) -> None:
    c_build.keep_builds_in(None)
    c_build.build_library(SOURCE)
    c_build.build_library(SOURCE)
    assert len(compiles) == 4
