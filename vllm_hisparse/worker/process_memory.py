"""What this process's mappings of a memory range hold, read from ``/proc/self``: the
fraction backed by 2 MiB pages (``smaps``), the proportional set size (``smaps`` Pss: shared
pages counted once across processes) and the bytes present (``pagemap``). The host pool logs
and reports them (``HostPool.memory_usage``); every reader returns None when ``/proc`` cannot
be read, never guesses."""

from __future__ import annotations

import mmap
import re

_SMAPS_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def huge_page_fraction(address: int) -> float | None:
    """Fraction of the mapping that starts at ``address`` backed by 2 MiB pages
    (``/proc/self/smaps``), or None when it cannot be read."""
    start = f"{address:x}-"
    found = False
    rss_kib = pmd_kib = 0
    page_kib = 4
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if not found:
                    found = line.startswith(start)
                    continue
                if _SMAPS_HEADER.match(line):
                    break  # the next mapping
                key, _, value = line.partition(":")
                fields = value.split()
                if not fields or not fields[0].isdigit():
                    continue
                if key == "Rss":
                    rss_kib = int(fields[0])
                elif key in ("ShmemPmdMapped", "FilePmdMapped", "AnonHugePages"):
                    pmd_kib += int(fields[0])
                elif key == "KernelPageSize":
                    page_kib = int(fields[0])
    except OSError:
        return None
    if not found:
        return None
    if page_kib >= 2048:
        return 1.0
    return pmd_kib / rss_kib if rss_kib else 0.0


def mapping_pss_bytes(address: int, length: int) -> int | None:
    """This process's proportional set size (Pss, ``/proc/self/smaps``) of the mappings that
    overlap ``[address, address + length)``; None when it cannot be read.

    A page mapped ``n`` times (by ``n`` processes, or by ``n`` mappings of one process)
    counts ``1/n`` in each mapping's Pss, so the Pss of every rank's mapping of a shared
    segment adds up to its physical memory once."""
    end = address + length
    pss_kib = 0
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if _SMAPS_HEADER.match(line):
                    lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
                    inside = lo < end and address < hi
                elif inside and line.startswith("Pss:"):
                    pss_kib += int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pss_kib << 10


def resident_bytes(address: int, length: int) -> int | None:
    """Bytes of ``[address, address + length)`` resident in this process's page tables
    (``/proc/self/pagemap``: the present bit of every 4 KiB page); None when it cannot be
    read. Exact to the range, unlike a mapping's Rss (an allocator's mapping holds more)."""
    import numpy as np

    page = mmap.PAGESIZE
    first, last = address // page, (address + length - 1) // page
    present = 0
    chunk_pages = 1 << 20  # 8 MiB of pagemap per read
    try:
        with open("/proc/self/pagemap", "rb") as f:
            for lo in range(first, last + 1, chunk_pages):
                n = min(chunk_pages, last + 1 - lo)
                f.seek(lo * 8)
                entries = np.frombuffer(f.read(n * 8), dtype=np.uint64)
                present += int(np.count_nonzero(entries >> np.uint64(63)))
    except (OSError, ValueError):
        return None
    return present * page
