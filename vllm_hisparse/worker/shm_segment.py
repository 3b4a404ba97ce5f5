"""Named shared-memory segments: one host pool mapped by several processes of one node.

A segment is a file in a memory file system, mapped ``MAP_SHARED`` by every process that uses
it, so all of them address the same physical pages:

* a ``hugetlbfs`` mount with 2 MiB pages (pages reserved by the administrator in
  ``/proc/sys/vm/nr_hugepages``), tried first;
* ``/dev/shm`` (tmpfs), with ``madvise(MADV_HUGEPAGE)``: 2 MiB pages only where the mount
  allows it (``huge=advise|always|within_size``), 4 KiB pages otherwise. What was obtained is
  measured from ``/proc/self/smaps``, not assumed.

File layout: a header (magic, length, JSON: geometry, data size, creator pid, page mode) at
offset 0, the data at ``DATA_OFFSET`` (2 MiB, so the data is huge-page aligned).

Protocol (no other communication between the processes):

* the **creator** makes a temporary file (``O_EXCL``, mode ``0600``) and holds an exclusive
  ``flock`` on it for its whole life; it sizes, maps and faults in the file, lets the caller
  pin it, writes the header and only then publishes it by hard-linking it to the final name
  (``link`` fails if the name exists: of two creators racing for one name exactly one
  publishes, the other gets a :class:`SegmentError`; an opener never sees a half-built
  segment);
* an **opener** polls the candidate directories for the final name until a deadline. A file
  whose lock can be taken shared has no live creator (it was left by a crashed run: the kernel
  drops the lock of a dead process) and is skipped. Openers that only read map it read-only;
* before attaching to or replacing a file, both check that it is a regular file owned by this
  user and not accessible to others (another user could plant a file under our name in the
  world-writable ``/dev/shm``): anything else is a :class:`SegmentError` naming the owner and
  mode. Every malformed header is a :class:`SegmentError` too;
* before creating, the creator removes **stale** files: names with our prefix, owned by this
  user, that no live creator holds (a killed engine leaves its pages allocated in tmpfs until
  then; the next start reclaims them and logs it). Other users' files are skipped;
* on close the creator unlinks the name; the memory is freed when the last process unmaps it.

``flock`` locks belong to the open file, not the pid, so the liveness test also holds across
containers that share ``/dev/shm`` but not a pid namespace.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

from vllm_hisparse.core.units import GIB
from vllm_hisparse.worker.process_memory import huge_page_fraction

logger = logging.getLogger("vllm_hisparse.worker")

SEGMENT_PREFIX = "vllm-hisparse-pool-"
DEFAULT_SHM_DIR = "/dev/shm"
HUGE_PAGE_BYTES = 2 << 20
DATA_OFFSET = HUGE_PAGE_BYTES  # header page; keeps the data 2 MiB-aligned in file and memory
_MAGIC = b"vllm-hisparse-v1"  # 16 bytes
_HEADER_LIMIT_BYTES = 64 << 10
_TMP_GRACE_S = 60.0  # a creator takes its lock right after O_EXCL; older unlocked temps are stale
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux uapi value
_FILE_MODE = 0o600
_PAGE_MODES = ("hugetlb", "thp", "small")

FsKind = Literal["hugetlbfs", "tmpfs"]


class SegmentError(RuntimeError):
    """A shared segment could not be created or opened (the message says why and what to do)."""


class SegmentTimeout(SegmentError, TimeoutError):
    """An opener waited longer than its timeout for the creator to publish the segment."""


@dataclass(frozen=True)
class Candidate:
    """A directory a segment may live in and its file system kind."""

    directory: str
    fs: FsKind


def _mounts() -> list[tuple[str, str, str]]:
    """``(mount point, fs type, options)`` of every mount, from ``/proc/mounts``."""
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 4:
            # Octal escapes (\040 for a space) as the kernel writes them.
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
            out.append((point, parts[2], parts[3]))
    return out


def _mount_of(path: str) -> tuple[str, str, str] | None:
    real = os.path.realpath(path)
    best = None
    for point, fs, opts in _mounts():
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (
                best is None or len(point) >= len(best[0])):
            best = (point, fs, opts)
    return best


def _default_huge_page_kib() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Hugepagesize:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _is_2mib_hugetlbfs(opts: str) -> bool:
    size = next((o.split("=", 1)[1] for o in opts.split(",") if o.startswith("pagesize=")), None)
    if size is None:
        return _default_huge_page_kib() == 2048
    return size.upper() in ("2M", "2048K")


def candidate_dirs(dirs: Sequence[str] | None = None) -> list[Candidate]:
    """Where segments are created and looked for, best first.

    ``dirs`` given: those directories (each classified by its mount). Otherwise every
    writable 2 MiB ``hugetlbfs`` mount, then ``/dev/shm``. Creator and openers compute the
    same list, so an opener finds the segment wherever the creator could put it."""
    if dirs:
        out = []
        for d in dirs:
            mount = _mount_of(d)
            out.append(Candidate(d, "hugetlbfs" if mount and mount[1] == "hugetlbfs" else "tmpfs"))
        return out
    out = [Candidate(point, "hugetlbfs") for point, fs, opts in _mounts()
           if fs == "hugetlbfs" and _is_2mib_hugetlbfs(opts) and os.access(point, os.W_OK)]
    return out + [Candidate(DEFAULT_SHM_DIR, "tmpfs")]


def segment_file_name(name: str) -> str:
    """The file name of segment ``name`` (the prefix marks our files for stale cleanup)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"shared segment name must match {_NAME_RE.pattern}, got {name!r}")
    return SEGMENT_PREFIX + name


def _flock_probe_is_free(fd: int) -> bool:
    """True when no live creator holds the file's exclusive lock (the probe's shared lock is
    dropped again at once)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def ownership_problem(st: os.stat_result, *, private: bool = True) -> str | None:
    """Why a segment file must not be attached to (None when it is ours and private).
    ``private=False``: only the owner matters (stale cleanup may remove any file of ours)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return (f"is owned by uid {st.st_uid}, this process runs as uid {os.geteuid()} "
                "(planted by another user, or left by another user's engine)")
    if private and st.st_mode & 0o077:
        return (f"has mode {stat.S_IMODE(st.st_mode):04o}; segments are created {_FILE_MODE:04o} "
                "(others could read or change the KV)")
    return None


def _refuse(path: str, problem: str) -> SegmentError:
    return SegmentError(
        f"host pool: refusing shared segment {path}: it {problem}. Remove the file if it is "
        "not yours to keep, or point VLLM_HISPARSE_SHM_DIR at a directory only this user "
        "can write")


def _header_pid(fd: int) -> str:
    try:
        return str(_parse_header(os.pread(fd, _HEADER_LIMIT_BYTES, 0), "").get("creator_pid"))
    except SegmentError:
        return "unknown"


def remove_stale_segments(candidates: Sequence[Candidate]) -> list[str]:
    """Unlink this user's segment files (our prefix) that no live creator holds; returns
    their paths. Other users' files are skipped (logged), never a reason to fail."""
    removed = []
    for cand in candidates:
        try:
            entries = os.listdir(cand.directory)
        except OSError:
            continue
        for entry in entries:
            if not entry.startswith(SEGMENT_PREFIX):
                continue
            path = os.path.join(cand.directory, entry)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue  # another user's private file, a dangling link, gone meanwhile
            try:
                st = os.fstat(fd)
                problem = ownership_problem(st, private=False)
                if problem is not None:
                    logger.info("host pool: leaving %s alone: it %s", path, problem)
                    continue
                if ".tmp." in entry and time.time() - st.st_mtime < _TMP_GRACE_S:
                    continue  # maybe a creator between O_EXCL and flock
                if not _flock_probe_is_free(fd):
                    continue
                try:
                    if os.stat(path).st_ino != st.st_ino:
                        continue  # replaced meanwhile
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                except PermissionError as exc:
                    logger.info("host pool: could not remove stale segment %s: %s", path, exc)
                    continue
                removed.append(path)
                logger.warning("host pool: removed stale shared segment %s (%.2f GiB) left by a "
                               "process that exited without closing it (creator pid %s): its "
                               "memory is reclaimed", path, st.st_size / GIB, _header_pid(fd))
            finally:
                os.close(fd)
    return removed


@dataclass
class Segment:
    """A mapped segment: the file, its descriptor (the creator's lock rides on it), the whole
    file's mapping, and the header. The data starts at ``DATA_OFFSET`` of the mapping and is
    ``data_bytes`` long."""

    path: str
    fs: FsKind
    fd: int
    mapping: mmap.mmap
    data_bytes: int
    created: bool
    header: dict[str, Any] = field(default_factory=dict)
    inode: int = 0

    def unlink(self) -> None:
        """Creator only: remove the name if it is still this segment's (idempotent)."""
        if not self.created or self.fd < 0:
            return
        try:
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close_file(self) -> None:
        """Close the descriptor (drops the creator's lock). The mapping is closed by the
        caller once no view references it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_header(mapping: mmap.mmap, header: dict[str, Any]) -> None:
    body = json.dumps(header, sort_keys=True).encode()
    if len(_MAGIC) + 8 + len(body) > _HEADER_LIMIT_BYTES:
        raise ValueError("shared segment header too large")
    mapping[0:len(_MAGIC) + 8 + len(body)] = _MAGIC + struct.pack("<Q", len(body)) + body


def _parse_header(raw: bytes, path: str) -> dict[str, Any]:
    """The header at the start of a segment file; :class:`SegmentError` for every defect."""
    def bad(why: str) -> SegmentError:
        return SegmentError(f"host pool: {path} is not a valid host pool segment ({why}); "
                            "remove it if no engine of this user is running")

    start = len(_MAGIC) + 8
    if len(raw) < start:
        raise bad(f"{len(raw)} B, shorter than the {start} B header prefix")
    if raw[:len(_MAGIC)] != _MAGIC:
        raise bad("bad magic")
    (length,) = struct.unpack("<Q", raw[len(_MAGIC):start])
    if start + length > min(len(raw), _HEADER_LIMIT_BYTES):
        raise bad(f"header length {length} B runs past the {min(len(raw), _HEADER_LIMIT_BYTES)} "
                  "B header area")
    try:
        header = json.loads(raw[start:start + length])
    except ValueError as exc:  # also UnicodeDecodeError
        raise bad(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    for key in ("data_offset", "data_bytes", "creator_pid"):
        value = header.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(f"header {key}={value!r}, accepted: an integer >= 0")
    if header["data_offset"] != DATA_OFFSET:
        raise bad(f"header data_offset={header['data_offset']}, this version uses {DATA_OFFSET}")
    if header.get("page_mode") not in _PAGE_MODES:
        raise bad(f"header page_mode={header.get('page_mode')!r}, accepted: "
                  f"{', '.join(_PAGE_MODES)}")
    return header


def _fault_in(mapping: mmap.mmap, start: int, length: int) -> None:
    """Allocate every page now, not at the first spill, so a shortage surfaces at startup.

    ``MADV_POPULATE_WRITE`` (Linux 5.14) faults the pages in through the mapping (honouring
    ``MADV_HUGEPAGE``) and reports a shortage as an error instead of ``SIGBUS``; older kernels
    get a memset."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE, start, length)
        return
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: the kernel does not know the advice
            raise
    import torch  # the worker layer has torch; a parallel memset

    view = torch.frombuffer(mapping, dtype=torch.uint8)[start:start + length]
    view.zero_()
    del view


def create_segment(name: str, data_bytes: int, header: dict[str, Any], *,
                   huge_pages: str = "auto", dirs: Sequence[str] | None = None,
                   on_mapped: Callable[[Segment], str | None] | None = None,
                   on_discard: Callable[[Segment], None] | None = None) -> Segment:
    """Create, fault in and publish segment ``name`` with ``data_bytes`` of data.

    ``on_mapped(segment)`` runs before publication (pinning); returning a reason string
    rejects this backing and the next candidate is tried. ``on_discard(segment)`` undoes it
    when a later step of the same candidate fails. ``huge_pages``: ``"auto"`` /
    ``"never"`` / ``"require"`` as for :class:`~vllm_hisparse.worker.HostPool`. The page mode
    is stored in ``segment.header["page_mode"]`` (``"hugetlb"``, ``"thp"`` or ``"small"``).
    Raises :class:`SegmentError` naming every candidate's failure."""
    file_name = segment_file_name(name)
    cands = candidate_dirs(dirs)
    remove_stale_segments(cands)
    file_bytes = DATA_OFFSET + -(-data_bytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    for cand in cands:
        final = os.path.join(cand.directory, file_name)
        try:
            fd = os.open(final, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            continue
        except OSError as exc:  # another user's private file, a symlink (ELOOP)
            raise _refuse(final, f"cannot be opened ({exc})") from None
        try:
            problem = ownership_problem(os.fstat(fd))
            if problem is not None:
                raise _refuse(final, problem)
            if not _flock_probe_is_free(fd):
                raise SegmentError(
                    f"host pool: shared segment {final} is held by a live process; two engines "
                    "with the same instance id and data-parallel rank on one node?")
        finally:
            os.close(fd)
    failures = []
    for cand in cands:
        if cand.fs == "hugetlbfs" and huge_pages == "never":
            continue
        reason = None
        try:
            segment, reason = _try_create(cand, file_name, data_bytes, file_bytes, header,
                                          huge_pages, on_mapped, on_discard)
        except OSError as exc:
            segment, reason = None, f"{type(exc).__name__}: {exc}"
        if segment is not None:
            return segment
        failures.append(f"{cand.directory} ({cand.fs}): {reason}")
        logger.info("host pool: shared segment not created in %s: %s", cand.directory, reason)
    raise SegmentError(
        f"host pool: could not create the shared host pool segment {file_name} "
        f"({file_bytes / GIB:.2f} GiB): " + "; ".join(failures)
        + ". Enlarge /dev/shm (docker: --shm-size or --ipc=host), reserve 2 MiB pages on a "
        "hugetlbfs mount, point VLLM_HISPARSE_SHM_DIR at a memory file system with room, or "
        "set VLLM_HISPARSE_SHARED_HOST_POOL=0 (one private pool per rank: TP times the memory)")


def _try_create(cand: Candidate, file_name: str, data_bytes: int, file_bytes: int,
                header: dict[str, Any], huge_pages: str,
                on_mapped: Callable[[Segment], str | None] | None,
                on_discard: Callable[[Segment], None] | None,
                ) -> tuple[Segment | None, str | None]:
    if cand.fs == "tmpfs":
        try:
            st = os.statvfs(cand.directory)
        except OSError as exc:
            return None, f"statvfs failed: {exc}"
        free = st.f_bavail * st.f_frsize
        if free < file_bytes:
            return None, (f"{free / GIB:.2f} GiB free, {file_bytes / GIB:.2f} GiB needed")
    final = os.path.join(cand.directory, file_name)
    tmp = f"{final}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    mapping = None
    accepted = None  # the segment on_mapped accepted (to undo if a later step fails)
    published = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for the segment's life
        os.ftruncate(fd, file_bytes)
        try:
            mapping = mmap.mmap(fd, file_bytes, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            return None, (f"mmap failed ({exc}); not enough free 2 MiB pages?"
                          if cand.fs == "hugetlbfs" else f"mmap failed ({exc})")
        if cand.fs == "tmpfs" and huge_pages != "never" and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        _fault_in(mapping, 0, file_bytes)
        if cand.fs == "hugetlbfs":
            mode = "hugetlb"
            fraction = 1.0
        else:
            import torch

            address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
            fraction = huge_page_fraction(address)
            mode = "thp" if fraction is not None and fraction >= 0.9 else "small"
        if huge_pages == "require" and mode == "small":
            return None, (f"2 MiB pages were required, {100 * (fraction or 0):.0f} % of the "
                          "tmpfs mapping got them (mount it with huge=advise, or reserve "
                          "hugetlbfs pages)")
        inode = os.fstat(fd).st_ino
        segment = Segment(path=final, fs=cand.fs, fd=fd, mapping=mapping, data_bytes=data_bytes,
                          created=True, inode=inode)
        full_header = dict(header, data_offset=DATA_OFFSET, data_bytes=data_bytes,
                           creator_pid=os.getpid(), page_mode=mode,
                           huge_page_fraction=fraction)
        segment.header = full_header
        if on_mapped is not None:
            reason = on_mapped(segment)
            if reason is not None:
                return None, reason
            accepted = segment
        _write_header(mapping, full_header)
        # link, not rename: rename would replace a segment another creator published since
        # the check in create_segment, and both would "succeed".
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise SegmentError(
                f"host pool: shared segment {final} was published by another process while "
                "this one built its own; two engines with the same instance id and "
                "data-parallel rank on one node?") from None
        published = True
        os.unlink(tmp)
        return segment, None
    finally:
        if not published:
            if accepted is not None and on_discard is not None:
                on_discard(accepted)
            if mapping is not None:
                try:
                    mapping.close()
                except BufferError:
                    pass
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            os.close(fd)


def open_segment(name: str, data_bytes: int, expect: dict[str, Any], *,
                 dirs: Sequence[str] | None = None, timeout_s: float = 600.0,
                 poll_s: float = 0.05, writable: bool = True) -> Segment:
    """Map segment ``name`` once its creator has published it.

    ``expect``: header entries that must match (geometry); a mismatch raises ``ValueError``
    naming both values. ``writable=False`` opens and maps it read-only (a write through the
    mapping faults). A file that is not this user's private regular file, or whose header
    is malformed, raises :class:`SegmentError` at once. Waits at most ``timeout_s``, then
    raises :class:`SegmentTimeout`."""
    file_name = segment_file_name(name)
    cands = candidate_dirs(dirs)
    deadline = time.monotonic() + timeout_s
    stale_seen: set[str] = set()
    delay = poll_s
    while True:
        for cand in cands:
            path = os.path.join(cand.directory, file_name)
            access = os.O_RDWR if writable else os.O_RDONLY
            try:
                fd = os.open(path, access | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                continue
            except OSError as exc:  # another user's private file, a symlink (ELOOP)
                raise _refuse(path, f"cannot be opened ({exc})") from None
            keep = False
            try:
                problem = ownership_problem(os.fstat(fd))
                if problem is not None:
                    raise _refuse(path, problem)
                if _flock_probe_is_free(fd):
                    if path not in stale_seen:
                        stale_seen.add(path)
                        logger.info("host pool: %s has no live creator (left by a crashed "
                                    "run); waiting for the creating rank to replace it", path)
                    continue
                header = _parse_header(os.pread(fd, _HEADER_LIMIT_BYTES, 0), path)
                for key, value in {**expect, "data_bytes": data_bytes}.items():
                    if header.get(key) != value:
                        raise ValueError(
                            f"host pool: shared segment {path} has {key}={header.get(key)!r}, "
                            f"this rank expects {value!r}; the ranks disagree on the pool "
                            "geometry")
                file_bytes = os.fstat(fd).st_size
                if file_bytes < header["data_offset"] + data_bytes:
                    raise SegmentError(f"host pool: {path} is {file_bytes} B, shorter than its "
                                       "header says")
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                mapping = mmap.mmap(fd, file_bytes, flags=mmap.MAP_SHARED, prot=prot)
                keep = True
                return Segment(path=path, fs=cand.fs, fd=fd, mapping=mapping,
                               data_bytes=data_bytes, created=False, header=header,
                               inode=os.fstat(fd).st_ino)
            finally:
                if not keep:
                    os.close(fd)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            where = ", ".join(c.directory for c in cands)
            stale = (f"; only a stale segment (no live creator) was found: "
                     f"{', '.join(sorted(stale_seen))}" if stale_seen else "")
            raise SegmentTimeout(
                f"host pool: timed out after {timeout_s:g} s waiting for the shared host "
                f"pool segment {file_name} in {where}{stale}. It is created by the replica's "
                "first tensor-parallel rank; if that rank failed, its log says why")
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.5)


__all__ = ["Candidate", "DATA_OFFSET", "SEGMENT_PREFIX", "Segment", "SegmentError", "SegmentTimeout",
           "candidate_dirs", "create_segment", "open_segment", "ownership_problem",
           "remove_stale_segments", "segment_file_name"]
