"""The glibc allocator setting that makes CPU training faster (stdlib only: call it before torch
allocates). Used by the `tmt` command and by the benchmark scripts, which must measure tmt as the
command runs it without importing the CLI."""

from __future__ import annotations

import ctypes
import os


def keep_freed_memory() -> None:
    """Make glibc keep freed memory instead of returning it to the OS.

    By default glibc serves every block over 32 MiB (logits and their gradients: hundreds of MB
    per step) with a fresh mmap and unmaps it when freed, so each step page-faults and zeroes the
    same memory again. Reusing it makes CPU training 20-35 % faster on our benchmark machine
    (scripts/bench_train.py). MALLOC_* variables set by the user win; a no-op where libc is not
    glibc.
    """
    if any(name.startswith("MALLOC_") for name in os.environ):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**31 - 1)
