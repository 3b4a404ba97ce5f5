"""The pinned host pool: every request's KV has a copy here (docs/design.md, "Layouts").

One allocation holds all layers; layer ``l`` is the uint8 view
``[num_blocks * block_size, row_bytes]`` and host row = ``host_block * block_size + offset``.

Layouts (``layout=``):

* ``"position"`` (default): position-major, ``[host_rows, num_layers, row_bytes]``. The rows of
  all layers of one position are adjacent, so a gather of one index group's layers at the same
  positions touches one or two 4 KiB translation pages per position instead of one per layer.
  Layer ``l`` is the **row-strided** view ``buffer.view(host_rows, L, row_bytes)[:, l]``
  (``stride(0) = L * row_bytes``), which the ops accept (docs/design.md, "Copies", docs/kernels.md).
  Needs ``L * row_bytes`` to be a multiple of 16 (true for 656 and 1152 B rows).
* ``"layer"``: layer-major, layer ``l`` is the contiguous slice
  ``[l * layer_bytes, (l + 1) * layer_bytes)``; the layout before position-major was measured.

Backing memory, best first (the choice is logged with logical and physical GiB):

1. ``hugetlb``: anonymous ``MAP_HUGETLB`` mapping (2 MiB pages reserved by the administrator),
   registered with ``cudaHostRegister``; when too few are free, the log says how many are
   and how many the pool needs (``vm.nr_hugepages``);
2. ``thp``: anonymous mapping with ``madvise(MADV_HUGEPAGE)`` (transparent 2 MiB pages),
   registered with ``cudaHostRegister``, which faults every page in; the share of the pool
   the kernel really backed with 2 MiB pages is then read from ``/proc/self/smaps``
   (``huge_page_fraction``) and logged, and a pool under 90 % counts as ``pinned``;
3. ``pinned``: ``torch.empty(pin_memory=True)`` (``cudaHostAlloc``, 4 KiB pages);
4. ``pageable``: plain memory, when no CUDA device exists (CPU tests, the simulator).

2 MiB pages matter for scattered zero-copy reads: with 4 KiB pages, GPU reads of random rows
over a multi-GB buffer lose bandwidth to host-side address translation (docs/benchmarks.md, "Translation reach").

**Shared pools** (``shared=SharedSegment(...)``): the tensor-parallel ranks of one replica on
one node hold identical sparse-MLA rows, so they map one pool. The backing memory is a named
file in a memory file system mapped ``MAP_SHARED`` (:mod:`~vllm_hisparse.worker.shm_segment`:
a 2 MiB ``hugetlbfs`` mount first, then ``/dev/shm`` with ``MADV_HUGEPAGE``); the writer rank
creates it, the others open it (bounded wait), every process registers its own mapping with
``cudaHostRegister``. Page modes are the same names: ``hugetlb``, ``thp`` (measured from
``/proc/self/smaps``), ``pinned`` (registered, 4 KiB pages) or ``pageable`` (not registered).
The creator counts the physical memory; the openers map it (``physical_gib == 0``).
Openers that only read (``SharedSegment(read_only=True)``: the TP ranks that do not write
the host pool) map it read-only, so a stray write faults instead of corrupting every rank's
KV; their ``buffer`` and ``layers`` must then never be written.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import threading
import warnings
import weakref
from typing import Literal, Sequence

import torch

from vllm_hisparse.core.capacity import host_blocks_for_budget
from vllm_hisparse.core.units import GIB
from vllm_hisparse.ops import host_ranges
from vllm_hisparse.worker import process_memory, shm_segment

logger = logging.getLogger("vllm_hisparse.worker")

PageMode = Literal["hugetlb", "thp", "pinned", "pageable"]
Layout = Literal["position", "layer"]
LAYOUTS = ("position", "layer")
DEFAULT_LAYOUT: Layout = "position"
HUGE_PAGE_BYTES = 2 << 20
_MAP_HUGETLB = 0x40000  # Linux, all architectures we build for
_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_READ_ONLY = 8  # the device only reads the range (read-only mappings)
#: Share of a ``thp`` pool that must sit in 2 MiB pages for it to count as ``thp``.
THP_MIN_FRACTION = 0.9


def hugetlb_pages(meminfo: str = "/proc/meminfo") -> tuple[int | None, int | None, int | None]:
    """``(HugePages_Total, HugePages_Free, Hugepagesize in KiB)`` of the default hugetlb pool
    (None for what cannot be read)."""
    values: dict[str, int] = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("HugePages_Total", "HugePages_Free", "Hugepagesize"):
                    values[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return (values.get("HugePages_Total"), values.get("HugePages_Free"),
            values.get("Hugepagesize"))


@dataclasses.dataclass(frozen=True)
class SharedSegment:
    """How a :class:`HostPool` shares its memory with the other ranks of one node.

    Args:
        name: segment name every rank derives without communication (``[A-Za-z0-9_.-]``);
            the file is ``vllm-hisparse-pool-<name>``.
        create: True for the one rank that creates (and later unlinks) the segment; the others
            open it.
        num_ranks: processes that map it (for the log).
        open_timeout_s: how long an opening rank waits for the creator's segment.
        dirs: directories to create it in / look for it in; None = every writable 2 MiB
            hugetlbfs mount, then ``/dev/shm``.
        read_only: an opener that never writes the pool maps it read-only (the creator
            always writes: it fills the header).
    """

    name: str
    create: bool
    num_ranks: int = 2
    open_timeout_s: float = 600.0
    dirs: Sequence[str] | None = None
    read_only: bool = False

    def __post_init__(self) -> None:
        shm_segment.segment_file_name(self.name)  # validates the name
        if self.create and self.read_only:
            raise ValueError("SharedSegment: the creating rank cannot map it read-only")
        if self.open_timeout_s <= 0:
            raise ValueError(f"SharedSegment: open_timeout_s must be > 0, got "
                             f"{self.open_timeout_s!r}")


class HostPool:
    """Pinned host memory for ``num_layers`` layers of ``num_blocks`` pages each.

    Args:
        num_layers: layers stored (the sparse-MLA layers of the model).
        num_blocks: host blocks (pages) per layer.
        block_size: rows per page.
        row_bytes: bytes of one row (656 for ``fp8_ds_mla``, 1152 for bf16).
        huge_pages: ``"auto"`` tries 2 MiB pages first, ``"never"`` uses ``pinned``/``pageable``,
            ``"require"`` fails unless 2 MiB pages were obtained.
        pin: register/pin the memory for GPU access (default: when CUDA is available).
        unpin_timeout_s: how long :meth:`close` waits for the unregistration before it gives
            up and logs (unpinning hundreds of GiB takes seconds; shutdown must not hang).
        layout: ``"position"`` (position-major, the default: layer views are row-strided) or
            ``"layer"`` (layer-major: each layer view is contiguous). See the module docstring.
        shared: map a pool shared with other processes of this node (see
            :class:`SharedSegment`); None = a private pool.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, row_bytes: int, *,
                 huge_pages: Literal["auto", "never", "require"] = "auto",
                 pin: bool | None = None, unpin_timeout_s: float = 30.0,
                 layout: Layout = DEFAULT_LAYOUT, shared: SharedSegment | None = None):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("row_bytes", row_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"HostPool: {name} must be a positive int, got {value!r}")
        if huge_pages not in ("auto", "never", "require"):
            raise ValueError(f"HostPool: huge_pages must be 'auto', 'never' or 'require', "
                             f"got {huge_pages!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"HostPool: layout must be 'position' or 'layer', got {layout!r}")
        if layout == "position" and num_layers > 1 and (num_layers * row_bytes) % 16:
            raise ValueError(f"HostPool: layout 'position' needs num_layers * row_bytes to be a "
                             f"multiple of 16 (the row stride of a layer view), got "
                             f"{num_layers} x {row_bytes} B; use layout='layer'")
        self.layout: Layout = layout
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.row_bytes = row_bytes
        self.rows_per_layer = num_blocks * block_size
        self.layer_bytes = self.rows_per_layer * row_bytes
        self.total_bytes = self.layer_bytes * num_layers
        self._unpin_timeout_s = unpin_timeout_s
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._mapping: mmap.mmap | None = None
        self._registered_ptr: int | None = None
        self.shared = shared
        self._segment: shm_segment.Segment | None = None
        self._unlink_at_exit: weakref.finalize | None = None
        #: Share of the pool backed by 2 MiB pages as measured after pinning (None when not
        #: measured: an unpinned pool's pages are not faulted in yet).
        self.huge_page_fraction: float | None = None
        if shared is None:
            self._buffer, self.page_mode = self._allocate(huge_pages)
        else:
            self._buffer, self.page_mode = self._allocate_shared(shared, huge_pages)
        if layout == "layer":
            self.row_stride = row_bytes
            self.layers: list[torch.Tensor] = [
                self._buffer[l * self.layer_bytes:(l + 1) * self.layer_bytes].view(
                    self.rows_per_layer, row_bytes)
                for l in range(num_layers)
            ]
        else:
            self.row_stride = num_layers * row_bytes
            rows = self._buffer.view(self.rows_per_layer, num_layers, row_bytes)
            self.layers = [rows[:, l, :] for l in range(num_layers)]
        geometry = (num_layers, num_blocks, block_size, row_bytes, self.logical_gib)
        if shared is None:
            logger.info("host pool: %d layers x %d blocks x %d rows x %d B = %.2f GiB logical, "
                        "%.2f GiB physical (private pool), pages: %s, layout: %s-major",
                        *geometry, self.physical_gib, self.page_mode, layout)
        elif self._segment.created:
            # Physical memory is logged once per node: by the creator.
            logger.info("host pool: %d layers x %d blocks x %d rows x %d B = %.2f GiB logical, "
                        "%.2f GiB physical (shared pool %s, mapped by %d ranks of this node), "
                        "pages: %s, layout: %s-major", *geometry, self.physical_gib,
                        self._segment.path, shared.num_ranks, self.page_mode, layout)
        else:
            logger.info("host pool: %d layers x %d blocks x %d rows x %d B = %.2f GiB logical, "
                        "mapped from the shared pool %s (its physical memory is counted by the "
                        "creating rank), pages: %s, layout: %s-major", *geometry,
                        self._segment.path, self.page_mode, layout)

    # ---------------------------------------------------------------- sizes

    @property
    def buffer(self) -> torch.Tensor:
        """The whole allocation as one flat uint8 tensor (bulk fills in tools and tests)."""
        if self._buffer is None:
            raise RuntimeError("HostPool: the pool is closed")
        return self._buffer

    @property
    def logical_gib(self) -> float:
        """Bytes this rank addresses, in GiB."""
        return self.total_bytes / GIB

    @property
    def physical_gib(self) -> float:
        """Host memory this pool accounts for, in GiB: all of it for a private pool and for
        the creator of a shared one, 0 for a rank that maps another rank's shared pool."""
        if self._segment is not None and not self._segment.created:
            return 0.0
        return self.total_bytes / GIB

    @property
    def creates_segment(self) -> bool:
        """True for a private pool and for the creator of a shared one."""
        return self._segment is None or self._segment.created

    @property
    def segment_path(self) -> str | None:
        """The shared segment's file (None for a private pool)."""
        return None if self._segment is None else self._segment.path

    def memory_usage(self) -> dict:
        """Host memory this pool holds in this process, measured, not derived from the
        geometry (all in bytes; -1 where the kernel's files cannot be read):

        * ``logical_bytes``: what this rank addresses;
        * ``resident_bytes``: pages of the pool present in this process
          (``process_memory.resident_bytes``): the whole pool on every rank that maps it;
        * ``pss_bytes``: this rank's proportional share: a private pool's resident bytes, a
          shared mapping's Pss (``process_memory.mapping_pss_bytes``: each page divided by its
          mappers), so the ``pss_bytes`` of all ranks add up to the memory held once;
        * ``segment_bytes``: pages allocated to the shared segment's file, counted once
          however many ranks map it (-1 for a private pool);
        * ``shared``: whether the pool is a shared segment."""
        address = self.buffer.data_ptr()
        resident = process_memory.resident_bytes(address, self.total_bytes)
        resident = -1 if resident is None else resident
        if self._segment is None:
            pss, segment_bytes = resident, -1
        else:
            pss = process_memory.mapping_pss_bytes(address, self.total_bytes)
            pss = -1 if pss is None else pss
            try:
                segment_bytes = os.fstat(self._segment.fd).st_blocks * 512
            except OSError:
                segment_bytes = -1
        return {"logical_bytes": self.total_bytes, "resident_bytes": resident, "pss_bytes": pss,
                "segment_bytes": segment_bytes, "shared": self._segment is not None}

    @classmethod
    def blocks_for_bytes(cls, pool_bytes: int, num_layers: int, block_size: int,
                         row_bytes: int) -> int:
        """How many host blocks ``pool_bytes`` hold for this geometry."""
        return host_blocks_for_budget(pool_bytes, num_layers * block_size * row_bytes, 1)

    # ---------------------------------------------------------------- allocation

    def _allocate(self, huge_pages: str) -> tuple[torch.Tensor, PageMode]:
        if huge_pages != "never":
            for mode in ("hugetlb", "thp"):
                buffer = self._try_mapping(mode)
                if buffer is None:
                    if mode == "hugetlb":
                        self._log_hugetlb_shortage()
                    continue
                if mode == "hugetlb":
                    self.huge_page_fraction = 1.0
                elif self._registered_ptr is not None:
                    mode = self._measured_thp(buffer)
                    if mode != "thp" and huge_pages == "require":
                        del buffer
                        self._release_mapping()
                        break
                return buffer, mode
            if huge_pages == "require":
                raise RuntimeError(
                    f"HostPool: 2 MiB pages were required but neither MAP_HUGETLB (reserve "
                    f"pages in /proc/sys/vm/nr_hugepages) nor transparent huge pages "
                    f"(/sys/kernel/mm/transparent_hugepage/enabled) gave "
                    f"{self.total_bytes / GIB:.2f} GiB")
            logger.info("host pool: 2 MiB pages unavailable, falling back to 4 KiB pages")
        if self._pin:
            return torch.empty(self.total_bytes, dtype=torch.uint8, pin_memory=True), "pinned"
        return torch.empty(self.total_bytes, dtype=torch.uint8), "pageable"

    def _release_mapping(self) -> None:
        """Unpin and unmap a private mapping that will not be used."""
        if self._registered_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None
        try:
            self._mapping.close()
        except BufferError:  # a view is still referenced; the GC unmaps it
            pass
        self._mapping = None

    def _log_hugetlb_shortage(self) -> None:
        total, free, page_kib = hugetlb_pages()
        need = -(-self.total_bytes // HUGE_PAGE_BYTES)
        if page_kib is not None and page_kib * 1024 != HUGE_PAGE_BYTES:
            logger.info("host pool: the default hugetlb page is %d KiB, not 2 MiB", page_kib)
        elif free is not None:
            logger.info("host pool: %d of %d reserved 2 MiB hugetlb pages are free, the pool "
                        "needs %d; reserve them (sysctl vm.nr_hugepages) for hugetlb pages",
                        free, total, need)

    def _measured_thp(self, buffer: torch.Tensor) -> PageMode:
        """The page mode of a pinned ``thp`` mapping as the kernel backed it: ``thp`` when
        at least 90 % of it is in 2 MiB pages, else ``pinned`` (registered 4 KiB pages)."""
        fraction = process_memory.huge_page_fraction(self._mapping_start)
        self.huge_page_fraction = fraction
        if fraction is None:
            return "thp"  # smaps unreadable: what was asked for
        if fraction >= THP_MIN_FRACTION:
            return "thp"
        logger.info("host pool: transparent huge pages requested, but the kernel backed only "
                    "%.0f %% of the pool with 2 MiB pages (transparent_hugepage setting, "
                    "fragmentation); it runs on 4 KiB pages", 100 * fraction)
        return "pinned"

    def _try_mapping(self, mode: str) -> torch.Tensor | None:
        size = -(-self.total_bytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        try:
            if mode == "hugetlb":
                mapping = mmap.mmap(-1, size, flags=flags | _MAP_HUGETLB)
            else:
                # Over-allocate one huge page so the view can start 2 MiB-aligned.
                mapping = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=flags)
                mapping.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError, AttributeError):
            return None
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        self._mapping_start = whole.data_ptr()
        offset = (-whole.data_ptr()) % HUGE_PAGE_BYTES if mode == "thp" else 0
        buffer = whole[offset:offset + self.total_bytes]
        if self._pin:
            err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), self.total_bytes,
                                                      _CUDA_HOST_REGISTER_PORTABLE)
            if int(err) != 0:
                logger.info("host pool: cudaHostRegister of a %s mapping failed (%s)", mode, err)
                del whole, buffer
                mapping.close()
                return None
            self._registered_ptr = buffer.data_ptr()
        self._mapping = mapping
        return buffer

    def _header(self) -> dict:
        return dict(num_layers=self.num_layers, num_blocks=self.num_blocks,
                    block_size=self.block_size, row_bytes=self.row_bytes, layout=self.layout)

    def _register(self, buffer: torch.Tensor, read_only: bool = False) -> str | None:
        """cudaHostRegister ``buffer``; the failure reason, or None when registered."""
        flags = _CUDA_HOST_REGISTER_PORTABLE | (_CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), self.total_bytes, flags)
        if int(err) != 0:
            return f"cudaHostRegister failed ({err})"
        self._registered_ptr = buffer.data_ptr()
        # torch's is_pinned() does not see every registered range (file-backed shared
        # mappings): tell the ops this one is GPU-accessible.
        host_ranges.add(self._registered_ptr, self.total_bytes)
        return None

    def _allocate_shared(self, shared: SharedSegment,
                         huge_pages: str) -> tuple[torch.Tensor, PageMode]:
        offset = shm_segment.DATA_OFFSET
        if shared.create:
            def pin_before_publishing(segment: shm_segment.Segment) -> str | None:
                if not self._pin:
                    return None
                whole = torch.frombuffer(segment.mapping, dtype=torch.uint8)
                reason = self._register(whole[offset:offset + self.total_bytes])
                del whole
                return reason

            def unpin(segment: shm_segment.Segment) -> None:
                if self._registered_ptr is not None:
                    host_ranges.remove(self._registered_ptr)
                    torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
                    self._registered_ptr = None

            segment = shm_segment.create_segment(
                shared.name, self.total_bytes, self._header(), huge_pages=huge_pages,
                dirs=shared.dirs, on_mapped=pin_before_publishing, on_discard=unpin)
            # A crash skips close(); at least a normal interpreter exit removes the name.
            self._unlink_at_exit = weakref.finalize(self, segment.unlink)
        else:
            segment = shm_segment.open_segment(
                shared.name, self.total_bytes, self._header(), dirs=shared.dirs,
                timeout_s=shared.open_timeout_s, writable=not shared.read_only)
        self._segment = segment
        self._mapping = segment.mapping
        with warnings.catch_warnings():
            # torch warns that it cannot mark a tensor over a read-only buffer read-only;
            # the mapping's protection is what enforces it.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            buffer = torch.frombuffer(segment.mapping, dtype=torch.uint8)[
                offset:offset + self.total_bytes]
        if self._pin and not shared.create:
            reason = self._register(buffer, read_only=shared.read_only)
            if reason is not None:
                del buffer
                self._mapping = None
                segment.mapping.close()
                segment.close_file()
                raise RuntimeError(f"HostPool: could not pin the shared pool {segment.path}: "
                                   f"{reason}")
        mode = segment.header["page_mode"]
        if mode == "small":
            mode = "pinned" if self._pin else "pageable"
            if segment.created:
                logger.info("host pool: the shared segment got 4 KiB pages (%s); for 2 MiB "
                            "pages reserve hugetlbfs pages or mount it with huge=advise",
                            segment.path)
        return buffer, mode

    # ---------------------------------------------------------------- lifetime

    @property
    def closed(self) -> bool:
        return self._buffer is None

    def close(self) -> None:
        """Unpin and release the memory. Views handed out earlier must not be used after this.

        The unregistration runs with a time bound: if it has not finished after
        ``unpin_timeout_s`` the pool logs and returns (the process is shutting down).
        """
        if self._buffer is None:
            return
        self.layers = []
        segment = self._segment
        if segment is not None:
            # The name goes first: no rank opens the segment from now on, and the memory is
            # freed when the last process unmaps it.
            segment.unlink()
            if self._unlink_at_exit is not None:
                self._unlink_at_exit.detach()
                self._unlink_at_exit = None
        if self._registered_ptr is not None:
            ptr = self._registered_ptr
            host_ranges.remove(ptr)
            done = threading.Event()

            def unregister():
                torch.cuda.cudart().cudaHostUnregister(ptr)
                done.set()

            threading.Thread(target=unregister, daemon=True, name="hisparse-unpin").start()
            if not done.wait(self._unpin_timeout_s):
                logger.warning("host pool: unpinning %.2f GiB did not finish within %.0f s; "
                               "leaving it to process exit", self.logical_gib,
                               self._unpin_timeout_s)
                self._buffer = None
                if segment is not None:
                    segment.close_file()
                return
            self._registered_ptr = None
        self._buffer = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a caller still holds a view; the OS frees it at exit
                logger.warning("host pool: a view is still referenced; mapping left to the GC")
            self._mapping = None
        if segment is not None:
            segment.close_file()  # the creator's lock goes with it

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        share = ("" if self._segment is None else
                 f", shared={self._segment.path} ({'creator' if self._segment.created else 'opener'})")
        return (f"HostPool(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, row_bytes={self.row_bytes}, "
                f"layout={self.layout}, "
                f"{self.logical_gib:.2f} GiB, pages={self.page_mode}{share})")
