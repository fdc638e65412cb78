"""Small C kernels built with gcc when the scheduler loads (paged_decode.c, w8a8_linear.c,
int8_bf16.c, rms_norm.c, fused_decode.c) and called through ctypes: no build step at
install, and each is compiled for the CPU it runs on (`-march=native`). Without a C
compiler, or if a build fails, the caller keeps torch's own kernels.

A build takes seconds (fused_decode.c the most), paid by every start: with
`keep_builds_in` set, a built library is kept there under a name keyed by what it was made
from (the sources, the compiler and its flags, the CPU) and loaded from there next time."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# -ffast-math lets gcc vectorize sums and exp (glibc's vector expf); compiled only, never
# linked with it: gcc 12 then links crtfastmath.o into the library, which at load turns on
# flush-to-zero for the whole process (subnormals gone; tests/model/test_paged_decode.py
# checks that loading a kernel keeps them).
# OpenMP: the runtime torch already loaded (same soname), so the kernels share its threads.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
SOURCES = Path(__file__).parent / "csrc"  # a kernel's source and what it includes
_kept_in: list[Path] = []  # where builds are kept between starts: `keep_builds_in`


def keep_builds_in(folder: Path | None) -> None:
    """Keep the libraries built from now on in `folder`, and load them from there when
    already built (None: build every time). Set before the kernels are first used."""
    _kept_in[:] = [] if folder is None else [folder]


def cpu_identity() -> str:
    """The CPU's model name and flags (the first processor's), and torch's ISA level."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor's block only
            fields[name.strip()] = value.strip()
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{fields.get('model name', '?')} | {fields.get('flags', '?')} | {capability}"


def build_library(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source` compiled with the usual flags plus `extra_flags` and loaded, or None."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.info("no C compiler on PATH: %s is not built, torch's kernels serve", source.name)
        return None
    kept = _kept_library(compiler, source, extra_flags)
    if kept is not None and kept.exists():
        try:
            return ctypes.CDLL(str(kept))
        except OSError as e:  # a broken file: built again below, and replaced
            logger.warning("could not load the kept build %s: %r", kept, e)
    with tempfile.TemporaryDirectory(prefix="redserve-kernel-") as folder:
        built, library = Path(folder) / f"{source.stem}.o", Path(folder) / f"{source.stem}.so"
        for command in (
            [compiler, *COMPILE_FLAGS, *extra_flags, str(source), "-o", str(built)],
            [compiler, *LINK_FLAGS, str(built), "-o", str(library), "-lm"],
        ):
            build = subprocess.run(command, capture_output=True, text=True)
            if build.returncode:
                logger.warning("%s did not build: %s", source.name, build.stderr[-2000:])
                return None
        if kept is not None:
            _keep(library, kept)
        return ctypes.CDLL(str(library))  # mapped: the file may go


def _kept_library(compiler: str, source: Path, extra_flags: tuple[str, ...]) -> Path | None:
    """Where a build of `source` with these flags is kept, or None (`keep_builds_in`)."""
    if not _kept_in:
        return None
    digest = hashlib.sha256()
    for part in (compiler, *COMPILE_FLAGS, *extra_flags, *LINK_FLAGS, cpu_identity()):
        digest.update(part.encode() + b"\0")
    digest.update(_compiler_version(compiler).encode())
    for path in sorted([source, *SOURCES.glob("*.[ch]")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return _kept_in[0] / f"{source.stem}-{digest.hexdigest()[:24]}.so"


@functools.cache
def _compiler_version(compiler: str) -> str:
    """What `compiler --version` says: asked once, not for every kernel a start builds."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def _keep(library: Path, kept: Path) -> None:
    """Copies the built `library` to `kept`, whole or not at all (a file of its own, then
    renamed: other schedulers may be loading it)."""
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".tmp{os.getpid()}")
        shutil.copyfile(library, partial)
        partial.replace(kept)
    except OSError as e:
        logger.warning("could not keep the build of %s in %s: %r", library.name, kept, e)
