"""Launch tuning of the CUDA kernels, carried by the ops backend object (:func:`ops.select`).

One immutable value per backend instead of process-wide settings: two backends in one process
(a connector and a benchmark, two tests) never see each other's tuning. The defaults are the
measured best on the H200 (docs/kernels.md); the reference twins ignore every field.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT_TUNING", "KernelTuning"]

_ROWS_PER_WARP = (0, 1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Tuning of the resolve and row-copy launches.

    resolve_threads: threads per resolve CTA, 0 (default: 1024) or 512 (taken only when
        D <= 8192; 1024 measured faster at every batch).
    max_tokens_per_request: query tokens (1 + speculative tokens) one request may have; sizes
        resolve's shared-memory hash. A request whose union overflows it fails with
        ``ResolveErrorCode.UNION_CAPACITY``. Within a launch the bound is also capped by T.
    copy_rows_per_warp: rows in flight per warp of the row copies (1, 2, 4, 8, 16; 0 = the
        kernel's default for the row size).
    copy_ctas_per_sm: grid cap of the row copies per SM (0 = the kernel's default).
    copy_pair_major: work order of the row copies. True: all layers of one (src, dst) pair are
        adjacent items (a warp reads all layers of a row together); False: layer by layer;
        None (default): pair-major exactly when a launch's layer views are row-strided
        (measured with a 24 GiB pool: docs/kernels.md "Host pool layout").
    """

    resolve_threads: int = 0
    max_tokens_per_request: int = 4
    copy_rows_per_warp: int = 0
    copy_ctas_per_sm: int = 0
    copy_pair_major: bool | None = None

    def __post_init__(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.resolve_threads not in (0, 512, 1024) or not is_int(self.resolve_threads):
            raise ValueError(f"resolve_threads must be 0 (default), 512 or 1024, got "
                             f"{self.resolve_threads!r}")
        if not is_int(self.max_tokens_per_request) or self.max_tokens_per_request < 1:
            raise ValueError(f"max_tokens_per_request must be a positive int, got "
                             f"{self.max_tokens_per_request!r}")
        if self.copy_rows_per_warp not in _ROWS_PER_WARP or not is_int(self.copy_rows_per_warp):
            raise ValueError(f"copy_rows_per_warp must be 0, 1, 2, 4, 8 or 16, got "
                             f"{self.copy_rows_per_warp!r}")
        if not is_int(self.copy_ctas_per_sm) or self.copy_ctas_per_sm < 0:
            raise ValueError(f"copy_ctas_per_sm must be a non-negative int, got "
                             f"{self.copy_ctas_per_sm!r}")
        if self.copy_pair_major not in (None, True, False):
            raise ValueError(f"copy_pair_major must be None, True or False, got "
                             f"{self.copy_pair_major!r}")

    @classmethod
    def from_options(cls, options: dict) -> "KernelTuning":
        """``KernelTuning(**options)`` with an unknown name reported as a ValueError."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"unknown kernel tuning option(s) {', '.join(unknown)}; accepted: "
                             f"{', '.join(sorted(fields))}")
        return cls(**options)


DEFAULT_TUNING = KernelTuning()
