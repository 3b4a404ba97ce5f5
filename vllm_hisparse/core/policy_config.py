"""The knobs of the residency policy and the watermarks they resolve to."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hisparse.core.hot_sizing import HotSizingConfig
from vllm_hisparse.core.units import cdiv


@dataclass
class PolicyConfig:
    """Knobs of the residency policy.

    Args:
        block_size: tokens per page (vLLM block size).
        max_num_rows: number of state rows (max concurrent requests known to the policy).
        max_pages_per_request: ``cdiv(max_model_len, block_size)``.
        device_buffer_size_rows: default hot rows per request; a multiple of ``block_size``.
        low_watermark_blocks: below this many free device blocks, demote (default
            ``max(2 * hot_blocks, 5 % of the pool)``).
        high_watermark_blocks: target for demotions and floor for promotions (default
            ``max(low + hot_blocks, 10 % of the pool)``).
        admission_window_pages: a FULL request holding more pages than this is demoted
            (chunked prefill outgrowing what admission reserved); None = no limit.
        eager_host_mirror: mirror every written row to host after each forward; otherwise
            spill whole pages once sealed.
        max_spill_pages_per_step / max_restore_pages_per_step: transfer budget per step.
        max_promotions_per_step: promotions started per step.
        min_steps_between_transitions: a request that changed residency waits this many
            steps before it may change again (second half of the hysteresis).
        hot_sizing: adaptive hot regions (``core/hot_regions.py``): each MIXED/NONE
            request's lease is resized from the miss counts the worker reports; None = every
            region keeps its size.
    """

    block_size: int
    max_num_rows: int
    max_pages_per_request: int
    device_buffer_size_rows: int
    low_watermark_blocks: int | None = None
    high_watermark_blocks: int | None = None
    admission_window_pages: int | None = None
    eager_host_mirror: bool = True
    max_spill_pages_per_step: int = 4096
    max_restore_pages_per_step: int = 1024
    max_promotions_per_step: int = 4
    min_steps_between_transitions: int = 8
    hot_sizing: HotSizingConfig | None = None

    def __post_init__(self) -> None:
        if self.device_buffer_size_rows <= 0 or self.device_buffer_size_rows % self.block_size:
            raise ValueError(
                f"device_buffer_size_rows={self.device_buffer_size_rows} must be a positive "
                f"multiple of block_size={self.block_size}"
            )
        if self.hot_sizing is not None and self.hot_sizing.block_size != self.block_size:
            raise ValueError(f"hot_sizing.block_size={self.hot_sizing.block_size} differs from "
                             f"block_size={self.block_size}")

    @property
    def hot_blocks_per_request(self) -> int:
        """Device blocks in a default hot region lease."""
        return self.device_buffer_size_rows // self.block_size

    def hot_blocks_for(self, hot_rows: int | None) -> int:
        """Device blocks of a hot region of ``hot_rows`` rows (None = the default)."""
        if hot_rows is None:
            return self.hot_blocks_per_request
        if hot_rows <= 0 or hot_rows % self.block_size:
            raise ValueError(f"hot_rows={hot_rows} must be a positive multiple of block_size")
        return hot_rows // self.block_size

    def watermarks(self, num_device_blocks: int) -> tuple[int, int]:
        """``(low, high)`` watermarks in free device blocks for a pool of ``num_device_blocks``."""
        hot = self.hot_blocks_per_request
        low = (
            self.low_watermark_blocks
            if self.low_watermark_blocks is not None
            else max(2 * hot, cdiv(num_device_blocks, 20))
        )
        high = (
            self.high_watermark_blocks
            if self.high_watermark_blocks is not None
            else max(low + hot, cdiv(num_device_blocks, 10))
        )
        if high < low:
            raise ValueError("high_watermark_blocks must be >= low_watermark_blocks")
        return low, high
