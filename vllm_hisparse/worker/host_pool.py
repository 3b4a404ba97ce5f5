"""The pinned host pool: every request's KV has a copy here (DESIGN.md §3 "host pool").

One allocation holds all layers; layer ``l`` is the uint8 view
``[num_blocks * block_size, row_bytes]`` and host row = ``host_block * block_size + offset``.

Layouts (``layout=``):

* ``"position"`` (default): position-major, ``[host_rows, num_layers, row_bytes]``. The rows of
  all layers of one position are adjacent, so a gather of one index group's layers at the same
  positions touches one or two 4 KiB translation pages per position instead of one per layer.
  Layer ``l`` is the **row-strided** view ``buffer.view(host_rows, L, row_bytes)[:, l]``
  (``stride(0) = L * row_bytes``), which the ops accept (DESIGN.md §4.2, docs/kernels.md).
  Needs ``L * row_bytes`` to be a multiple of 16 (true for 656 and 1152 B rows).
* ``"layer"``: layer-major, layer ``l`` is the contiguous slice
  ``[l * layer_bytes, (l + 1) * layer_bytes)``; the layout before position-major was measured.

Backing memory, best first (the choice is logged with logical and physical GiB):

1. ``hugetlb``: anonymous ``MAP_HUGETLB`` mapping (2 MiB pages reserved by the administrator),
   registered with ``cudaHostRegister``;
2. ``thp``: anonymous mapping with ``madvise(MADV_HUGEPAGE)`` (transparent 2 MiB pages),
   registered with ``cudaHostRegister``;
3. ``pinned``: ``torch.empty(pin_memory=True)`` (``cudaHostAlloc``, 4 KiB pages);
4. ``pageable``: plain memory, when no CUDA device exists (CPU tests, the simulator).

2 MiB pages matter for scattered zero-copy reads: with 4 KiB pages, GPU reads of random rows
over a multi-GB buffer lose bandwidth to host-side address translation (DESIGN.md §8).

Tensor-parallel ranks each map a private pool (logical = physical per rank); a shared pool
across ranks is not implemented yet.
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import Literal

import torch

logger = logging.getLogger("vllm_hisparse.worker")

PageMode = Literal["hugetlb", "thp", "pinned", "pageable"]
Layout = Literal["position", "layer"]
LAYOUTS = ("position", "layer")
DEFAULT_LAYOUT: Layout = "position"
HUGE_PAGE_BYTES = 2 << 20
_MAP_HUGETLB = 0x40000  # Linux, all architectures we build for
_CUDA_HOST_REGISTER_PORTABLE = 1
GIB = 1 << 30


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
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, row_bytes: int, *,
                 huge_pages: Literal["auto", "never", "require"] = "auto",
                 pin: bool | None = None, unpin_timeout_s: float = 30.0,
                 layout: Layout = DEFAULT_LAYOUT):
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
        self._buffer, self.page_mode = self._allocate(huge_pages)
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
        logger.info("host pool: %d layers x %d blocks x %d rows x %d B = %.2f GiB logical, "
                    "%.2f GiB physical (private pool), pages: %s, layout: %s-major",
                    num_layers, num_blocks, block_size, row_bytes, self.logical_gib,
                    self.physical_gib, self.page_mode, layout)

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
        """Bytes of host memory this rank holds, in GiB (equal to logical: private pool)."""
        return self.total_bytes / GIB

    @classmethod
    def blocks_for_bytes(cls, pool_bytes: int, num_layers: int, block_size: int,
                         row_bytes: int) -> int:
        """How many host blocks ``pool_bytes`` hold for this geometry."""
        return pool_bytes // (num_layers * block_size * row_bytes)

    # ---------------------------------------------------------------- allocation

    def _allocate(self, huge_pages: str) -> tuple[torch.Tensor, PageMode]:
        if huge_pages != "never":
            for mode in ("hugetlb", "thp"):
                buffer = self._try_mapping(mode)
                if buffer is not None:
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
        if self._registered_ptr is not None:
            ptr = self._registered_ptr
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
                return
            self._registered_ptr = None
        self._buffer = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a caller still holds a view; the OS frees it at exit
                logger.warning("host pool: a view is still referenced; mapping left to the GC")
            self._mapping = None

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HostPool(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, row_bytes={self.row_bytes}, "
                f"layout={self.layout}, "
                f"{self.logical_gib:.2f} GiB, pages={self.page_mode})")
