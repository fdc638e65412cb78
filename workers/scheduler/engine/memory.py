"""How much memory the KV cache gets, and how the CPU allocator keeps what steps free."""

from __future__ import annotations

import ctypes
import math
import mmap
from pathlib import Path

import psutil
import torch

from workers.scheduler.model.config import ModelArgs


def kv_bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    return 2 * args.num_layers * args.num_kv_heads * args.head_dim * dtype.itemsize


def available_memory(device: torch.device) -> int:
    """Bytes that new tensors on `device` can take now (on CPU, within the container's
    cgroup limit too: psutil sees the host's memory)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = int(psutil.virtual_memory().available)
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit():
            available = min(available, int(limit) - usage)
        break
    return max(0, available)


_CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


# glibc's mallopt() parameters (malloc.h) and the largest mmap threshold it takes on 64 bits.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20
_TRIM_THRESHOLD = 2**30


def keep_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for reuse instead of handing it back to the
    kernel; whether it could (False off glibc). A CPU step allocates and frees tens of MB of
    temporaries per layer (gathered K/V, their fp32 copies); with glibc's default, adaptive
    thresholds they are unmapped or trimmed and faulted back in page by page, so the
    process spends much of its CPU in the kernel and steps run slower at many streams
    (measured in bench/README.md). Blocks up to 32 MiB come from the heap, and up to 1 GiB
    of free heap is kept: the process holds its peak of temporaries."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )


def num_kv_blocks_for(
    max_blocks: int, memory_fraction: float, available_bytes: int, bytes_per_block: int
) -> int:
    """KV cache blocks: `memory_fraction` of `available_bytes`, and at most `max_blocks`
    (either one 0 = no bound from it, not both)."""
    if not (max_blocks or memory_fraction):
        raise ValueError("size the KV cache with a block count or a memory fraction")
    bounds = [max_blocks] if max_blocks else []
    if memory_fraction:
        bounds.append(int(available_bytes * memory_fraction) // bytes_per_block)
    num_blocks = min(bounds)
    if num_blocks < 1:
        raise MemoryError(
            f"no room for a KV cache: {memory_fraction} of {available_bytes / 2**20:.0f} MiB "
            f"is less than one block ({bytes_per_block / 2**20:.1f} MiB)"
        )
    return num_blocks


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros for a KV cache. On CPU in fresh private anonymous pages, which the kernel hands
    out zero-filled as steps first write them: `torch.zeros` writes every byte at start,
    seconds for a cache of several GB before the scheduler takes a job. So the process's
    memory grows into the cache as it fills instead. Claiming the pages from a background
    thread at start (madvise MADV_POPULATE_WRITE) was tried and dropped: it competed with the
    first steps for the CPU (both measured in bench/README.md, sittings G and H)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    pages = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=flags)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)
