"""Small C kernels built with gcc when the scheduler loads (paged_decode.c, w8a8_linear.c,
int8_bf16.c, rms_norm.c) and called through ctypes: no build step at install, and each is
compiled for the CPU it runs on (`-march=native`). Without a C compiler, or if a build
fails, the caller keeps torch's own kernels."""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# -ffast-math lets gcc vectorize sums and exp (glibc's vector expf); compiled only, never
# linked with it: gcc 12 then links crtfastmath.o into the library, which at load turns on
# flush-to-zero for the whole process (subnormals gone; tests/model/test_paged_decode.py
# checks that loading a kernel keeps them).
# OpenMP: the runtime torch already loaded (same soname), so the kernels share its threads.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")


def build_library(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source` compiled with the usual flags plus `extra_flags` and loaded, or None."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.info("no C compiler on PATH: %s is not built, torch's kernels serve", source.name)
        return None
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
        return ctypes.CDLL(str(library))  # mapped: the file may go
