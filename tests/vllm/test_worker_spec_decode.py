"""Speculative decoding through the worker role (CPU, reference ops): verify rows and
rejected drafts, every row read checked against ground truth.

Each step schedules ``1 + k`` tokens per request. The fake forward writes the right KV for
the last sampled token and the accepted drafts, and KV of another token sequence for the
rejected ones; the scheduler side rolls them back (``ResidencyPolicy.roll_back``) before
the step's acks are delivered (out of order, some steps late), and the next step writes
those positions again. Attention runs every verify row of every request through the
installed hook: the resolver gets all of a request's rows at once (one state row, their
union of selections), and every selected row must hold the right KV, resident, hot or
copied from the host.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.vllm.test_worker_side import (  # noqa: F401  (fixtures)
    BS,
    TOP_K,
    Rig,
    _unhook,
    assert_nothing_leaked,
    model_dir,
)
from vllm_hisparse.core import Outcome, Residency
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata
from vllm_hisparse.worker.synthetic import kv_rows

#: Serial offset of the KV a rejected draft writes (a token sequence the request never had).
REJECTED = 10_000


class SpecRig(Rig):
    """The worker-side rig with speculative steps (module docstring)."""

    _truth: dict = {}

    def spec_step(self, plan: dict[str, tuple[int, int]]) -> None:
        ranges, kept = [], []
        for rid, (n, accepted) in plan.items():
            row = self.policy.row_of(rid)
            start = int(self.policy.tables.num_tokens[row])
            if self.policy.schedule(rid, n) == Outcome.OK:
                ranges.append((rid, row, start, start + n))
                kept.append(start + 1 + accepted)
        cmd = self.policy.build_step()
        from tests.vllm.test_worker_side import shift_blocks

        meta = HiSparseConnectorMetadata(command=shift_blocks(cmd, self.lead), bundles=self.bundles)
        batch = [r[0] for r in ranges]
        out = type("Out", (), {"num_scheduled_tokens": {r[0]: r[3] - r[2] for r in ranges}})()
        self.role.start_load_kv(meta, request_ids=batch, scheduler_output=out)
        for (rid, row, start, end), keep in zip(ranges, kept):
            self.write_kv(rid, row, start, keep)
            if keep < end:  # rejected drafts: KV of a sequence the request never had
                self.write_kv(rid, row, keep, end, serial=REJECTED + self.serial[rid])
        if ranges:
            self.attend_verify_rows(ranges)
        self.role.wait_for_save()
        rows = np.array([r[1] for r in ranges], dtype=np.int64)
        self.policy.roll_back(rows, np.array(kept, dtype=np.int64))  # before the acks
        for rid in plan:
            self.residency_seen.add(int(self.policy.residency(rid)))
        self.deliver_acks()
        self.policy.check_invariants()

    def check_rows(self, lane, i, rows, counts, topk, decode, stride):
        """``Rig.check_rows``, per request rather than per token, against a ground truth
        computed once per request and layer (verify rows read many more rows)."""
        view = lane.device_layers[i]
        layer = self.layer_ids[(lane.group_id, i)]
        valid = topk >= 0
        assert torch.equal(counts, valid.sum(dim=1, dtype=torch.int32))
        kept = torch.arange(rows.shape[1])[None, :] < counts[:, None]
        owner = [rid for _, (rid, *_) in decode]
        for rid in dict.fromkeys(owner):
            mine = torch.tensor([o == rid for o in owner])
            if (rid, layer) not in self._truth:
                self._truth[(rid, layer)] = kv_rows(self.serial[rid], torch.arange(self.role.max_pages * BS),
                                                    layer, view.shape[1])
            want_pos = topk[mine][valid[mine]].to(torch.int64)
            got = view[rows[mine][kept[mine]].to(torch.int64)]
            bad = (got != self._truth[(rid, layer)][want_pos]).any(dim=1).nonzero().flatten()
            assert bad.numel() == 0, f"{rid} layer {layer}: position {int(want_pos[bad[0]])} wrong"
            self.reads_checked += int(want_pos.numel())

    def attend_verify_rows(self, ranges):
        """Every scheduled token of every request: batch row ``b`` repeated for its tokens,
        each token with its own selection over the verified context (positions before the
        step: ``Rig.attend`` selects over a range's end, so each token's range ends at the
        step's start)."""
        tokens = [(b, (rid, row, start, start)) for b, (rid, row, start, end) in enumerate(ranges)
                  for _ in range(end - start)]
        self.max_tokens_per_step = max(getattr(self, "max_tokens_per_step", 0), len(tokens))
        self.attend(ranges, tokens, "flat")


@pytest.mark.parametrize("k,steps", [pytest.param(3, 24, id="k3"),
                                     pytest.param(6, 36, id="k6-long", marks=pytest.mark.slow)])
def test_verify_rows_and_rejected_drafts_read_ground_truth(model_dir, k, steps):
    # 768 prompt tokens + steps * (1 + k) must stay within the rig's max_model_len (1024).
    assert 768 + steps * (1 + k) <= 1024
    rig = SpecRig(model_dir, num_blocks=200, policy_blocks=70, seed=k, num_speculative_tokens=k)
    rig._truth = {}
    assert rig.hs_config.max_decode_query_len == 1 + k
    assert rig.hs_config.device_buffer_size == (k + 2) * TOP_K
    rng = random.Random(k)
    ids = [f"r{i}" for i in range(5)]
    for rid in ids:
        rig.add(rid)
    for rid in ids:  # 12 pages each: a demotion frees more than its hot region costs
        rig.step({rid: 768}, attend=False)
    for _ in range(steps):
        rig.spec_step({rid: (1 + k, rng.choice([0, k, rng.randint(0, k)])) for rid in ids})
    for rid in ids:
        rig.policy.finish(rid)
    rig.drain()
    assert int(Residency.MIXED) in rig.residency_seen, "the loop never exercised residency"
    assert rig.policy.stats.num_rolled_back_tokens > 0
    assert rig.reads_checked > 0 and rig.max_tokens_per_step == 5 * (1 + k)
    reduced = rig.role.get_stats(sync=True).reduce()
    assert reduced["misses"] > 0
    assert_nothing_leaked(rig)
    rig.role.shutdown()
