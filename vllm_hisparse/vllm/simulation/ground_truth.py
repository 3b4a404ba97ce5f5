"""The simulator's checker: what every KV row must hold, and the comparison with what was read.

A real model's KV at position ``p`` is a function of the tokens ``0 .. p`` only, so two
requests whose token sequences agree up to ``p`` hold the same KV there, whichever of them
(or whichever step) computed it: vLLM's prefix cache relies on exactly that when it hands one
request blocks another request computed, earlier or in the same step, prompt or decode
positions alike. The synthetic model keeps that property: the row of ``(request, position,
layer)`` is ``worker.synthetic.kv_rows(owner, position, layer)`` where ``owner`` is the
smallest serial of the requests whose tokens agree with this request's up to ``position``
(:func:`prefix_owners`). A row from a request with other tokens, another position or layer,
or a corrupted byte never matches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from vllm_hisparse.worker.synthetic import HEADER_BYTES, describe_row, kv_rows

#: Layer offset of the indexer rows' synthetic KV (distinct from the sparse-MLA rows').
INDEXER_LAYER_BASE = 1_000


class SimulationFailure(RuntimeError):
    """The system under simulation failed (a refused step, a leak, a worker error)."""


class SimulationMismatch(SimulationFailure):
    """A row read through the conversion path is not the ground truth of its selection."""

    def __init__(self, message: str, *, request: str, step: int, layer: int, position: int):
        super().__init__(message)
        self.request, self.step, self.layer, self.position = request, step, layer, position


def prefix_owners(sequences: Mapping[int, Sequence[int]]) -> dict[int, list[tuple[int, int]]]:
    """serial -> ``[(first_position, owner), ...]``, ascending: from ``first_position`` on
    (up to the next entry) the KV of the request is that of ``owner``, the smallest serial
    whose tokens agree with the request's up to and including the position. The last owner
    is the request itself unless another request's sequence extends it. Cost: one pass over
    the positions that some two requests share."""
    owners: dict[int, list[tuple[int, int]]] = {s: [] for s in sequences}
    alike = [sorted(sequences)]  # groups of serials with equal tokens so far
    position = 0
    while alike:
        still_alike = []
        for group in alike:
            by_token: dict[int, list[int]] = {}
            for serial in group:
                tokens = sequences[serial]
                if position < len(tokens):
                    by_token.setdefault(tokens[position], []).append(serial)
            for members in by_token.values():
                owner = members[0]  # groups stay sorted: the smallest serial
                for serial in members:
                    if not owners[serial] or owners[serial][-1][1] != owner:
                        owners[serial].append((position, owner))
                if len(members) > 1:
                    still_alike.append(members)
        alike = still_alike
        position += 1
    return owners


class GroundTruth:
    """The KV every request's rows must hold, kept per request in a store slot.

    Args:
        sequences: serial -> every token of the request (prompt and sampled tokens).
        num_layers: sparse-MLA layers (store rows per position).
        max_model_len: store positions per layer.
        block_size: tokens per KV block (for messages).
        row_bytes: bytes per sparse-MLA KV row.
        device: where the store lives (the KV device).
    """

    def __init__(self, sequences: Mapping[int, Sequence[int]], *, num_layers: int,
                 max_model_len: int, block_size: int, row_bytes: int, device: torch.device):
        self._owners = prefix_owners(sequences)
        self._lengths = {s: len(t) for s, t in sequences.items()}
        self.num_layers, self.max_model_len = num_layers, max_model_len
        self.block_size = block_size
        self.row_bytes, self.device = row_bytes, device
        #: uint8 ``[slots, layers, max_model_len, row_bytes]``: every layer's KV of every
        #: position of the requests holding a slot; grown on demand.
        self.store: torch.Tensor | None = None
        self._slots: dict[int, int] = {}
        self._free_slots: list[int] = []

    def owner(self, serial: int, position: int) -> int:
        """The serial whose KV request ``serial`` holds at ``position``."""
        owner = serial
        for first, who in self._owners[serial]:
            if first > position:
                break
            owner = who
        return owner

    def rows(self, serial: int, positions: torch.Tensor, layer: int,
             row_bytes: int) -> torch.Tensor:
        """uint8 ``[len(positions), row_bytes]``: the KV request ``serial`` must hold at
        ``positions`` (int64, any order) of ``layer``."""
        out = torch.empty((positions.shape[0], row_bytes), dtype=torch.uint8,
                          device=positions.device)
        segments = self._owners[serial] or [(0, serial)]
        ends = [first for first, _ in segments[1:]] + [None]
        for (first, owner), end in zip(segments, ends):
            inside = positions >= first
            if end is not None:
                inside &= positions < end
            if bool(inside.all()):
                return kv_rows(owner, positions, layer, row_bytes)
            if bool(inside.any()):
                out[inside] = kv_rows(owner, positions[inside], layer, row_bytes)
        return out

    def indexer_rows(self, serial: int, positions: torch.Tensor, layer: int,
                     row_bytes: int) -> torch.Tensor:
        """The indexer KV request ``serial`` must hold at ``positions`` of indexer ``layer``."""
        return self.rows(serial, positions, INDEXER_LAYER_BASE + layer, row_bytes)

    def slot(self, serial: int) -> int:
        """The request's slot in :attr:`store`, filled on first use."""
        if serial in self._slots:
            return self._slots[serial]
        if not self._free_slots:
            old = self.store
            grow = max(4, 0 if old is None else old.shape[0])
            fresh = torch.empty((grow, self.num_layers, self.max_model_len, self.row_bytes),
                                dtype=torch.uint8, device=self.device)
            first = 0 if old is None else old.shape[0]
            self.store = fresh if old is None else torch.cat([old, fresh])
            self._free_slots = list(range(first + grow - 1, first - 1, -1))
        slot = self._slots[serial] = self._free_slots.pop()
        pos = torch.arange(self._lengths[serial], device=self.device)
        for layer in range(self.num_layers):
            self.store[slot, layer, :pos.shape[0]] = self.rows(serial, pos, layer,
                                                               self.row_bytes)
        return slot

    def release(self, serial: int) -> None:
        """The request finished: its slot is free for the next one."""
        slot = self._slots.pop(serial, None)
        if slot is not None:
            self._free_slots.append(slot)

    def check_conversion(self, rows: torch.Tensor, counts: torch.Tensor, topk: torch.Tensor,
                         spans: Sequence[tuple[str, int, int, int, int]], layer: int,
                         view: torch.Tensor, *, any_order: bool,
                         fail: Callable[[str, int, str], None],
                         request_note: Callable[[str], str]) -> int:
        """Every valid row a conversion returned must hold the ground truth of its selection
        (whole rows compared). Returns the rows checked.

        Args:
            rows: int32 ``[>= T, K]`` rows the conversion returned, valid ones first.
            counts: int32 ``[>= T]`` valid rows per token.
            topk: int32 ``[T, K]`` the selections (request positions, -1 padded at the end).
            spans: ``(request id, serial, first token, tokens, first position)`` per request
                of the batch, in token order.
            layer: the model layer.
            view: uint8 ``[rows, row_bytes]`` flat row view of the layer's device KV.
            any_order: accept a token whose rows are a permutation of the right ones (vLLM's
                CUDA conversion guarantees only the set of a token's valid rows).
            fail: ``fail(request id, token position, what)``; raises.
            request_note: text appended to a wrong row's description (request state).
        """
        num_tokens, k = topk.shape
        counts_want = (topk >= 0).sum(dim=1)
        counts = counts[:num_tokens].to(torch.int64)
        if not torch.equal(counts, counts_want):
            t = int((counts != counts_want).nonzero()[0])
            rid, _, token_pos = _token(t, spans)
            fail(rid, token_pos, f"the conversion returned {int(counts[t])} rows "
                 f"for {int(counts_want[t])} selections")
        mask = torch.arange(k, device=topk.device)[None, :] < counts_want[:, None]
        got_rows = rows[:num_tokens].to(torch.int64)[mask]
        positions = topk.to(torch.int64)[mask]
        if got_rows.numel() and (int(got_rows.min()) < 0 or int(got_rows.max()) >= view.shape[0]):
            i = int(((got_rows < 0) | (got_rows >= view.shape[0])).nonzero()[0])
            rid, _, token_pos = _token(_token_of(i, counts_want), spans)
            fail(rid, token_pos, f"selection of position {int(positions[i])} "
                 f"converted to row {int(got_rows[i])}, outside the layer's "
                 f"{view.shape[0]} rows")
        got = view.index_select(0, got_rows)
        slot_of_token = torch.cat([torch.full((n,), self.slot(serial), dtype=torch.int64)
                                   for _, serial, _, n, _ in spans]).to(topk.device)
        store = self.store  # after slot(): it may have grown
        per_slot = store.shape[1] * store.shape[2]
        index = (slot_of_token.repeat_interleave(counts_want) * per_slot
                 + layer * store.shape[2] + positions)
        want = store.view(-1, self.row_bytes).index_select(0, index)
        if not torch.equal(got, want):
            bad = (got != want).any(dim=1).nonzero().flatten()
            if not (any_order and _same_sets(bad, got, want, counts_want)):
                i = int(bad[0])
                rid, serial, token_pos = _token(_token_of(i, counts_want), spans)
                p = int(positions[i])
                differs = (got[i] != want[i]).nonzero().flatten()
                if bool(torch.equal(got[i, :HEADER_BYTES], want[i, :HEADER_BYTES])):
                    held = (f"the right row header but {differs.numel()} corrupted bytes "
                            f"(first at byte {int(differs[0])})")
                else:
                    what = ("an unwritten (all-zero) row" if not bool(got[i].any())
                            else describe_row(got[i].cpu()))
                    held = (f"{what}, not (request {self.owner(serial, p)}, position {p}, "
                            f"layer {layer})")
                fail(rid, token_pos, f"selected position {p} (page {p // self.block_size}) "
                     f"read row {int(got_rows[i])} holding {held}{request_note(rid)}; "
                     f"{bad.numel()} of {got.shape[0]} rows wrong")
        return got.shape[0]


def _token_of(i: int, counts_want: torch.Tensor) -> int:
    """Token of flattened valid selection ``i``."""
    cum = counts_want.cumsum(0)
    return int(torch.searchsorted(cum, torch.tensor([i], device=cum.device), right=True))


def _token(t: int, spans) -> tuple[str, int, int]:
    """(request id, serial, position) of batch token ``t``."""
    for rid, serial, t0, n, start in spans:
        if t0 <= t < t0 + n:
            return rid, serial, start + t - t0
    raise AssertionError("token outside the batch")


def _same_sets(bad, got, want, counts_want) -> bool:
    """Whether every token with a wrong row holds a permutation of its right rows."""
    ends = counts_want.cumsum(0)
    for t in torch.unique(torch.searchsorted(ends, bad, right=True)).tolist():
        a, b = int(ends[t] - counts_want[t]), int(ends[t])
        if ({bytes(r.cpu().numpy()) for r in got[a:b]}
                != {bytes(r.cpu().numpy()) for r in want[a:b]}):
            return False
    return True
