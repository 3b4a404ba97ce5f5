"""Speculative decoding (MTP) through the connector on vLLM's real Scheduler (CPU).

The fake forward accepts a scripted number of each request's drafts and samples the bonus
token; the fake drafter proposes ``k`` drafts for every request after each step (the
engine core's ``update_draft_token_ids``). Only the forward, the drafter and the worker's
acks are fake. After every step the policy must hold exactly vLLM's verified length for
every request and no host row at or past it (``check_invariants``), under pressure (pages
released and reused) and with acks arriving late (open mirrors clipped).
"""

from __future__ import annotations

import random

import pytest

from tests.vllm.fake_worker import FakeWorker
from tests.vllm.scheduler_harness import SchedulerHarness
from vllm_hisparse.vllm.simulation.model import kv_transfer_config, make_vllm_config
from vllm_hisparse.vllm.setup.config import HiSparseConfigError, default_device_buffer_size
from vllm_hisparse.vllm.setup.engine_checks import resolve_config
from vllm_hisparse.vllm.setup.kv_plan import indexer_group_ids, sparse_group_ids
from vllm_hisparse.vllm.scheduler_side.drafts import DraftRollback


def build(model_dir, *, k, block_size=64, num_blocks=400, delay=0, num_draft_layers=0,
          max_model_len=2048, extra=None, **kw):
    return SchedulerHarness.build(
        model_dir,
        kv_transfer=kv_transfer_config({"host_pool_gib": 1, **(extra or {})}),
        worker=FakeWorker(delay_steps=delay),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=512,
        block_size=block_size,
        num_speculative_tokens=k,
        num_draft_layers=num_draft_layers,
        **kw,
    )


def check_starts(harness):
    """Every step's tokens start where vLLM's verified length is (checked as each step's
    metadata is built: vLLM advances ``num_computed_tokens`` only after that)."""
    residency = harness.residency
    real = harness.connector.build_connector_meta

    def checked(scheduler_output):
        meta = real(scheduler_output)
        t = residency.policy.tables
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            row = residency.book.row_of[rid]
            assert int(t.num_tokens[row]) == harness.requests[rid].num_computed_tokens + n, rid
        return meta

    harness.connector.build_connector_meta = checked


def run_checked(harness, *, count, prompt_len, max_tokens, max_steps=20_000):
    """Run to completion, checking every step's start (``check_starts``) and the policy's
    invariants (no host row at or past a request's length) after every step."""
    requests = harness.add_requests(count, prompt_len=prompt_len, max_tokens=max_tokens)
    check_starts(harness)
    while harness.scheduler.has_requests():
        assert harness.stats.steps < max_steps
        harness.step()
        harness.residency.policy.check_invariants()
    harness.drain()
    for _ in range(3):  # the last acks
        harness.step()
    harness.drain()
    assert all(r.is_finished() for r in requests)
    assert all(len(r.output_token_ids) == max_tokens for r in requests)
    harness.assert_no_leaks()
    return requests


ACCEPT = {
    "all": lambda rng: (lambda request, n: n),
    "none": lambda rng: (lambda request, n: 0),
    "random": lambda rng: (lambda request, n: rng.choice([0, n, rng.randint(0, n)])),
}


@pytest.mark.parametrize("pattern", list(ACCEPT))
def test_drafts_accepted_and_rejected_under_pressure(small_topk_model_dir, pattern):
    """k = 3 (MTP), 8 requests on a pool that holds ~3 at full length: requests go MIXED,
    pages are released and reused, acks arrive a step late; every rejected draft is rolled
    back before the acks that would have made its rows valid."""
    harness = build(small_topk_model_dir, k=3, delay=1)
    harness.accept = ACCEPT[pattern](random.Random(7))
    run_checked(harness, count=8, prompt_len=1024, max_tokens=256)
    stats = harness.residency.policy.stats
    rejected = harness.num_drafts - harness.num_accepted
    assert harness.num_drafts > 0
    if pattern == "all":
        assert rejected == 0 and stats.num_rolled_back_tokens == 0
    else:
        # Rejections of a request's last step (it finished) need no rollback.
        assert 0 < stats.num_rolled_back_tokens <= rejected
    assert stats.num_demotions > 0 and stats.num_pages_released > 0


@pytest.mark.parametrize("k,block_size", [(7, 16), (15, 16)], ids=["k7b16", "k15b16"])
def test_large_k_with_small_blocks(small_topk_model_dir, k, block_size):
    """B7: one step's drafts span more pages than the always-resident tail (k + 1 >= a
    page), rejected in full or in part, acks two steps late, pool under pressure.

    The hot region is the smallest one step allows, ``(k + 1) * top_k`` rows, and requests
    are longer than it by a margin: a demotion needs a net gain (a request no longer than
    its hot region stays resident), and without demotions nothing would be released."""
    hot_rows = (k + 1) * 128
    harness = build(small_topk_model_dir, k=k, block_size=block_size, num_blocks=1600, delay=2,
                    max_model_len=4096, extra={"device_buffer_size": hot_rows})
    rng = random.Random(k)
    harness.accept = lambda request, n: rng.choice([0, 0, 1, n // 2, n])
    run_checked(harness, count=8, prompt_len=hot_rows + 768, max_tokens=192)
    stats = harness.residency.policy.stats
    assert stats.num_rolled_back_tokens > 0 and stats.num_pages_released > 0


def test_without_the_rollback_the_policy_keeps_rejected_rows(small_topk_model_dir, monkeypatch):
    """The check above can fail: with the rollback switched off the policy's length runs
    ahead of vLLM's verified one (and rejected rows would count as mirrored)."""
    monkeypatch.setattr(DraftRollback, "roll_back_rejected", lambda self: None)
    harness = build(small_topk_model_dir, k=3)
    harness.accept = lambda request, n: 0
    with pytest.raises(AssertionError):
        run_checked(harness, count=2, prompt_len=256, max_tokens=32)


def test_draft_layers_stay_resident(small_topk_model_dir):
    """MTP layers (``is_draft``) are planned in their own groups, which the policy never
    manages: under pressure the sparse groups' tables get null (released and reused)
    pages, the draft groups never do."""
    harness = build(small_topk_model_dir, k=1, num_draft_layers=1)
    harness.accept = lambda request, n: n
    config = harness.kv_cache_config
    sparse, indexer = sparse_group_ids(config), indexer_group_ids(config)
    draft = [g for g in range(len(config.kv_cache_groups)) if g not in sparse and g not in indexer]
    assert draft and all("layers.4." in n for g in draft for n in config.kv_cache_groups[g].layer_names)
    managers = harness.scheduler.kv_cache_manager.coordinator.single_type_managers
    nulls = {"sparse": 0, "draft": 0}
    real = harness.connector.build_connector_meta

    def counted(scheduler_output):
        meta = real(scheduler_output)
        for kind, groups in (("sparse", sparse), ("draft", draft)):
            for g in groups:
                nulls[kind] += sum(b.is_null for blocks in managers[g].req_to_blocks.values() for b in blocks)
        return meta

    harness.connector.build_connector_meta = counted
    run_checked(harness, count=8, prompt_len=1024, max_tokens=256)
    assert nulls["sparse"] > 0 and nulls["draft"] == 0
    # The host tier does not hold the draft layers' pages: no host-prefix hits.
    assert not harness.residency.host_prefix.enabled


def test_device_buffer_default_follows_the_spec_config(small_topk_model_dir):
    """``device_buffer_size`` defaults to (max_decode_query_len + 1) * top_k with
    max_decode_query_len = 1 + num_speculative_tokens from vLLM's speculative config."""
    for k in (0, 1, 3):
        config = resolve_config(make_vllm_config(small_topk_model_dir, kv_transfer=kv_transfer_config(),
                                                 num_speculative_tokens=k))
        assert config.max_decode_query_len == 1 + k
        assert config.device_buffer_size == default_device_buffer_size(128, 64, 1 + k) == (k + 2) * 128


def test_async_scheduling_with_drafts_is_refused(small_topk_model_dir):
    """Refused when the VllmConfig is built; the engine's second line refuses a config
    switched to async scheduling afterwards."""
    message = (r"async_scheduling=True with speculative decoding \(num_speculative_tokens=2\); "
               r"accepted: --no-async-scheduling")
    with pytest.raises(ValueError, match=message):
        make_vllm_config(small_topk_model_dir, kv_transfer=kv_transfer_config(),
                         num_speculative_tokens=2, async_scheduling=True)
    vllm_config = make_vllm_config(small_topk_model_dir, kv_transfer=kv_transfer_config(),
                                   num_speculative_tokens=2)
    vllm_config.scheduler_config.async_scheduling = True
    with pytest.raises(HiSparseConfigError, match=message):
        resolve_config(vllm_config)
