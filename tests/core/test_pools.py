"""Scenario tests for the host block pool and the in-memory device pool."""

from __future__ import annotations

import pytest

from vllm_hisparse.core import (
    BackPressure,
    DevicePoolExhausted,
    HostBlockPool,
    HostPoolExhausted,
    InMemoryDevicePool,
    ProtocolError,
)


# -- host pool ------------------------------------------------------------------------------
def test_host_pool_refcounts_and_publication_lifecycle():
    """Allocate two blocks, share one, publish it once durable, free: it stays cached."""
    pool = HostBlockPool(4)
    a, b = pool.allocate(2)
    assert pool.num_free_blocks == 2
    pool.touch([a])  # a second request shares block a
    assert pool.ref_counts[a] == 2
    assert pool.publish(a, "h0") is True
    assert pool.publish(b, "h0") is False  # the first durable copy keeps the identity
    assert pool.lookup(["h0", "h1"]) == [a]
    pool.free([a, a, b])
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 3
    assert pool.lookup(["h0"]) == [a]  # still a prefix hit while cached
    pool.touch([a])  # a hit takes a lease: no longer evictable
    assert pool.num_cached_blocks == 0
    pool.free([a])
    with pytest.raises(ProtocolError):
        pool.free([a])  # refcounts never go negative


def test_host_pool_evicts_least_recently_used_cached_blocks():
    """Store h0, h1, h2 (cached); touch h0 again; a full pool evicts h1 first, then h2."""
    pool = HostBlockPool(3)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.publish(block, f"h{i}")
    pool.free(blocks)
    pool.touch([blocks[0]])
    pool.free([blocks[0]])  # h0 is now the most recently used
    (new,) = pool.allocate(1)
    assert new == blocks[1] and pool.lookup(["h1"]) == []
    assert pool.lookup(["h0"]) == [blocks[0]] and pool.num_evictions == 1
    pool.allocate(1)
    assert pool.lookup(["h2"]) == [] and pool.lookup(["h0"]) == [blocks[0]]


def test_full_host_pool_is_back_pressure_and_changes_nothing():
    """A request for more blocks than free + evictable raises a catchable outcome, no partial take."""
    pool = HostBlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(HostPoolExhausted) as info:
        pool.allocate(2)
    assert isinstance(info.value, BackPressure)
    assert info.value.num_requested == 2 and info.value.num_available == 1
    assert pool.num_free_blocks == 1 and list(pool.ref_counts[held]) == [1, 1, 1]


def test_host_publish_requires_a_lease():
    """Publishing a block nobody holds would let a prefix hit read a recycled block."""
    pool = HostBlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ProtocolError):
        pool.publish(block, "h")


# -- device pool ----------------------------------------------------------------------------
def test_device_release_readable_calls_back_on_reuse_only():
    """A released block stays readable; the callback fires when the pool hands it out again."""
    pool = InMemoryDevicePool(3)
    reused = []
    a, b, c = pool.get_new_blocks(3)
    pool.release_readable([a], reused.append)
    pool.free_blocks([b])  # garbage block: reused before the readable one
    assert pool.get_num_free_blocks() == 2
    assert pool.get_new_blocks(1) == [b] and reused == []
    assert pool.get_new_blocks(1) == [a] and reused == [a]


def test_device_touch_repins_a_released_block_without_reuse():
    """Touch pulls a released block out of the free queue; nothing is reused, no callback."""
    pool = InMemoryDevicePool(2)
    reused = []
    a, b = pool.get_new_blocks(2)
    pool.release_readable([a], reused.append)
    pool.touch([a])
    assert pool.ref_counts[a] == 1 and pool.get_num_free_blocks() == 0
    with pytest.raises(DevicePoolExhausted):
        pool.get_new_blocks(1)
    assert reused == []


def test_device_pool_exhaustion_is_all_or_nothing_and_double_free_is_an_error():
    """Asking for more than free raises back-pressure and takes nothing."""
    pool = InMemoryDevicePool(2)
    (a,) = pool.get_new_blocks(1)
    with pytest.raises(DevicePoolExhausted):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1
    pool.free_blocks([a])
    with pytest.raises(ProtocolError):
        pool.free_blocks([a])
