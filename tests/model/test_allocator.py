"""The scheduler keeps freed CPU memory instead of faulting it back in every step."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# A decode layer's temporaries as contexts grow a token per step: gathered K and V (bf16),
# their fp32 copies, the attention output. Prints the minor page faults of 30 such steps.
CHURN = """
import resource, sys, torch
from workers.scheduler.engine.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def layers(first_len):
    for kv_len in range(first_len, first_len + 30):
        kv = [torch.empty(64 * kv_len * 192, dtype=torch.bfloat16).fill_(1) for _ in range(2)]
        upcast = [t.float() for t in kv]
        out = torch.empty(64 * 9 * 64).fill_(1)
        del kv, upcast, out
layers(100)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
layers(200)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_kept_memory_spares_the_page_faults_of_growing_temporaries() -> None:
    default, kept = _faults("default"), _faults("keep")
    # glibc's adaptive thresholds fault each growing temporary in anew: tens of times more.
    assert kept * 10 < default, (default, kept)
