"""How much host memory a command may still allocate, checked before a large allocation: a
pool larger than that would grow until the kernel's OOM killer ends the process."""

from __future__ import annotations

from vllm_hisparse.core.units import GIB

_CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_memory() -> tuple[int | None, str]:
    """``(bytes, how)``: what can still be allocated, the smaller of the kernel's
    ``MemAvailable`` and the cgroup's limit minus its usage; ``None`` when neither is known."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in _CGROUP_FILES:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:
            limits.append((limit - usage, f"cgroup limit {limit / GIB:.1f} GiB minus "
                                          f"{usage / GIB:.1f} GiB in use"))
            break
    if not limits:
        return None, "unknown"
    return min(limits)


def check_fits_in_memory(flag: str, gib: float, *, what: str = "the host pool",
                         total_gib: float | None = None) -> None:
    """Raise ``ValueError`` naming ``flag`` (given ``gib``) when ``what`` (``total_gib``,
    default ``gib``) cannot be allocated here."""
    total_gib = gib if total_gib is None else total_gib
    free, how = available_memory()
    if free is not None and total_gib * GIB > free:
        raise ValueError(f"{flag}={gib:g} does not fit: {what} would take {total_gib:g} GiB, "
                         f"this machine can allocate {free / GIB:.1f} GiB ({how})")
