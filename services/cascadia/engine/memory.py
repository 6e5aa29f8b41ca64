"""Giving memory back to the system once a stage is compiled, and counting what the process holds."""

from __future__ import annotations

import ctypes
import gc


def release_unused_memory() -> None:
    """Collect garbage and return the heap's free pages to the system.

    Loading and compiling a stage allocates far more than the compiled model keeps (converted weight
    blocks, graph building, the plugin's transformations). glibc keeps what is freed in its arenas,
    where it still counts as the process's resident memory until trimmed.
    """
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator returns memory by its own rules
        return
    libc.malloc_trim(0)


def resident_in_use() -> int:
    """Resident bytes the system cannot take back without swap: resident memory less its file-backed
    and shared pages. A stage's mapped weight files stay resident after compiling beside the plugin's
    own copy of the weights (`cascadia.engine.mapped`), but they are reclaimed under pressure."""
    import psutil

    resident = psutil.Process().memory_info()
    return resident.rss - resident.shared
