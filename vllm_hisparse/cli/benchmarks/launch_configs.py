"""The fastest launch config of a Triton stand-in kernel, chosen once per key by timing.

Triton's own ``autotune`` differs between the Triton of the development venv and the GPU
machine's, and its timing allocates a 256 MB cache-flush buffer, which a KV pool sized to
fill the GPU may not leave. This chooser times each candidate on the call's own arguments with
CUDA events (the first launch compiles; a config the GPU cannot run, too much shared memory,
is skipped) and keeps the fastest per key. It must choose outside CUDA-graph capture: the
benchmark's eager warm-up step before each capture does that.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

#: Launches timed per candidate after its compiling one (the minimum is kept).
TIMED_LAUNCHES = 3


def _unrunnable_errors() -> tuple[type[BaseException], ...]:
    """Triton's errors for a config the GPU cannot run (names moved between versions)."""
    errors: list[type[BaseException]] = []
    try:
        from triton.runtime.errors import OutOfResources
        errors.append(OutOfResources)
    except ImportError:
        pass
    try:
        from triton.runtime.errors import PTXASError
        errors.append(PTXASError)
    except ImportError:
        pass
    return tuple(errors)


class LaunchChooser:
    """Per key, the fastest of the configs given with its first call (dicts a launch
    understands: a kernel's block sizes, ``num_warps``, ``num_stages``, anything the launch
    reads). On a CPU tensor (Triton's interpreter, in tests) the first config, untimed."""

    def __init__(self, name: str):
        self.name = name
        self.chosen: dict[Hashable, dict] = {}

    def run(self, key: Hashable, configs: Callable[[], list[dict]],
            launch: Callable[[dict], None], device: torch.device) -> dict:
        """Launch with the key's config, choosing it first among ``configs()`` if the key is
        new."""
        config = self.chosen.get(key)
        if config is None:
            config = self._choose(key, configs(), launch, device)
        launch(config)
        return config

    def _choose(self, key: Hashable, configs: list[dict], launch: Callable[[dict], None],
                device: torch.device) -> dict:
        if not configs:
            raise ValueError(f"{self.name}: no launch configs for {key!r}")
        if device.type != "cuda":
            self.chosen[key] = configs[0]
            return configs[0]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.name}: launch config for {key!r} not chosen before "
                               "CUDA-graph capture (run the step once eagerly first)")
        unrunnable = _unrunnable_errors()
        best, best_ms = None, float("inf")
        for config in configs:
            try:
                launch(config)  # compiles
            except unrunnable:
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(TIMED_LAUNCHES):
                start.record()
                launch(config)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            if min(times) < best_ms:
                best, best_ms = config, min(times)
        if best is None:
            raise RuntimeError(f"{self.name}: none of its {len(configs)} launch configs "
                               f"runs on this GPU for {key!r}")
        self.chosen[key] = best
        return best
