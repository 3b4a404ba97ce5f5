"""A host pool shared by the tensor-parallel ranks of one node (docs/worker.md, "Tensor
parallelism: one host pool per node"): segment creation and opening across processes, the
bounded wait, unlink on close, stale segments of crashed runs, and writer-only transfers.

Processes are started with ``spawn`` (as vLLM starts its workers); their bodies are in
``shared_pool_procs.py``. The data test runs on CPU here and with ``-m gpu`` on cuda:0 (two
processes on one GPU, pinned shared memory, the CUDA kernels)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import uuid

import pytest
import torch

from tests.worker import shared_pool_procs as procs
from vllm_hisparse.worker import process_memory, shm_segment
from vllm_hisparse.worker.host_pool import HostPool, SharedSegment
from vllm_hisparse.worker.transfer import TransferEngine

GEOMETRY = (2, 6, 4, 64)  # layers, host blocks, block size, row bytes
CTX = mp.get_context("spawn")


@pytest.fixture
def shm_dir():
    """A private directory in /dev/shm (tmpfs, like production) or in /tmp without it."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix="hisparse-test-", dir=root)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def spec(shm_dir, name, create, **kw):
    return dict(name=name, create=create, dirs=(shm_dir,), **kw)


def new_name() -> str:
    return uuid.uuid4().hex[:16]


def get(q, timeout=120):
    msg = q.get(timeout=timeout)
    assert msg[0] != "error", msg[1]
    return msg


# ------------------------------------------------------------------------ segment mechanics


def test_two_processes_map_one_pool(shm_dir):
    name = new_name()
    out, release = CTX.Queue(), CTX.Event()
    creator = CTX.Process(target=procs.create_and_hold,
                          args=(spec(shm_dir, name, True), GEOMETRY, 7, out, release))
    creator.start()
    try:
        # Opened while the creator may still be building it: the opener waits.
        reader = HostPool(*GEOMETRY, huge_pages="never", pin=False,
                          shared=SharedSegment(**spec(shm_dir, name, False, open_timeout_s=120)))
        _, path, mode, physical = get(out)
        assert reader.segment_path == path
        assert os.path.basename(path) == shm_segment.SEGMENT_PREFIX + name
        assert mode in ("thp", "pageable") and physical == reader.total_bytes / 2**30
        assert reader.physical_gib == 0.0 and not reader.creates_segment
        # The creator's bytes, seen through this process's mapping and layer views.
        assert torch.equal(reader.buffer, procs.pattern(reader.total_bytes, 7))
        L, bs, rb = GEOMETRY[0], GEOMETRY[2], GEOMETRY[3]
        flat = procs.pattern(reader.total_bytes, 7).view(-1, L, rb)
        for l in range(L):
            assert torch.equal(reader.layers[l], flat[:, l])
        # Writes go both ways (one physical pool).
        reader.layers[1][5].fill_(0xEE)
        reader.close()
        assert os.path.exists(path), "an opener must not unlink the creator's segment"
        release.set()
        _, exists_after_close = get(out)
        assert not exists_after_close, "the creator unlinks the segment on close"
    finally:
        release.set()
        creator.join(60)
    assert creator.exitcode == 0
    assert os.listdir(shm_dir) == []


def test_opener_times_out_with_a_clear_error(shm_dir):
    name = new_name()
    with pytest.raises(TimeoutError, match=rf"timed out after 0.3 s waiting for the shared host "
                       rf"pool segment {shm_segment.SEGMENT_PREFIX}{name} in {shm_dir}.*first "
                       "tensor-parallel rank"):
        HostPool(*GEOMETRY, pin=False,
                 shared=SharedSegment(**spec(shm_dir, name, False, open_timeout_s=0.3)))


def test_close_unlinks_and_reopening_needs_a_new_creator(shm_dir):
    name = new_name()
    creator = HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, True)))
    path = creator.segment_path
    opener = HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, False)))
    creator.buffer[:16] = 9
    assert bool((opener.buffer[:16] == 9).all())
    creator.close()
    assert not os.path.exists(path)
    # The opener's mapping stays valid after the name is gone.
    assert bool((opener.buffer[:16] == 9).all())
    opener.close()
    with pytest.raises(TimeoutError):
        HostPool(*GEOMETRY, pin=False,
                 shared=SharedSegment(**spec(shm_dir, name, False, open_timeout_s=0.2)))


def test_stale_segment_of_a_crashed_creator_is_replaced(shm_dir, caplog):
    name = new_name()
    out, release = CTX.Queue(), CTX.Event()
    crashed = CTX.Process(target=procs.create_and_hold,
                          args=(spec(shm_dir, name, True), GEOMETRY, 1, out, release, True))
    crashed.start()
    _, path, _, _ = get(out)
    crashed.join(60)
    assert os.path.exists(path), "a crashed creator leaves its segment behind"
    # An opener does not take the stale segment: it waits for a live creator.
    with pytest.raises(TimeoutError, match="only a stale segment"):
        HostPool(*GEOMETRY, pin=False,
                 shared=SharedSegment(**spec(shm_dir, name, False, open_timeout_s=0.3)))
    # Another crashed run's segment under another name is cleaned up too.
    other = os.path.join(shm_dir, shm_segment.SEGMENT_PREFIX + "other-run")
    with open(other, "wb") as f:
        f.write(b"\0" * 4096)
    with caplog.at_level(logging.WARNING, logger="vllm_hisparse.worker"):
        creator = HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, True)))
    assert f"removed stale shared segment {path}" in caplog.text
    assert not os.path.exists(other)
    creator.buffer.copy_(procs.pattern(creator.total_bytes, 2))
    opener = HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, False)))
    assert torch.equal(opener.buffer, procs.pattern(opener.total_bytes, 2))
    opener.close()
    creator.close()
    assert os.listdir(shm_dir) == []


def test_a_live_segment_name_is_not_taken_over(shm_dir):
    name = new_name()
    first = HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, True)))
    try:
        with pytest.raises(shm_segment.SegmentError, match="held by a live process"):
            HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, True)))
        assert os.path.exists(first.segment_path)
    finally:
        first.close()


def test_opener_with_another_geometry_is_refused(shm_dir):
    name = new_name()
    with HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, True))):
        layers, blocks, bs, rb = GEOMETRY
        with pytest.raises(ValueError, match=r"has num_blocks=6, this rank expects 7"):
            HostPool(layers, blocks + 1, bs, rb, pin=False,
                     shared=SharedSegment(**spec(shm_dir, name, False)))


@pytest.mark.parametrize("created, opened", [("position", "layer"), ("layer", "position")])
def test_opener_with_another_layout_is_refused(shm_dir, created, opened):
    """host_layout is decided per rank from the same model, but a rank configured otherwise
    must not read a layer-major pool as position-major (every row would be another's)."""
    name = new_name()
    with HostPool(*GEOMETRY, pin=False, layout=created,
                  shared=SharedSegment(**spec(shm_dir, name, True))):
        with pytest.raises(ValueError, match=rf"has layout='{created}', this rank expects "
                                             rf"'{opened}'; the ranks disagree"):
            HostPool(*GEOMETRY, pin=False, layout=opened,
                     shared=SharedSegment(**spec(shm_dir, name, False)))


def test_no_room_for_the_segment_names_the_fix(shm_dir, monkeypatch):
    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(shm_segment.os, "statvfs", lambda path: Tiny())
    with pytest.raises(shm_segment.SegmentError,
                       match=r"0\.00 GiB free.*Enlarge /dev/shm.*VLLM_HISPARSE_SHARED_HOST_POOL=0"):
        HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, new_name(), True)))
    assert os.listdir(shm_dir) == []


def test_require_huge_pages_is_honoured_or_refused(shm_dir):
    """``huge_pages="require"``: 2 MiB pages (measured) or an error, never 4 KiB silently."""
    name = new_name()
    try:
        pool = HostPool(*GEOMETRY, huge_pages="require", pin=False,
                        shared=SharedSegment(**spec(shm_dir, name, True)))
    except shm_segment.SegmentError as exc:
        assert "2 MiB pages were required" in str(exc)
        assert os.listdir(shm_dir) == []
    else:
        assert pool.page_mode in ("thp", "hugetlb")
        pool.close()


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 200, "sp ace"])
def test_bad_segment_names_are_refused(bad):
    with pytest.raises(ValueError, match="shared segment name"):
        SharedSegment(name=bad, create=True)


def test_page_mode_is_measured():
    """``huge_page_fraction`` reads smaps: an anonymous mapping of 4 KiB pages reports < 1."""
    import mmap

    m = mmap.mmap(-1, 1 << 20)
    m[:] = b"\1" * (1 << 20)
    address = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
    fraction = process_memory.huge_page_fraction(address)
    assert fraction is not None and 0.0 <= fraction <= 1.0
    assert process_memory.huge_page_fraction(1) is None  # no mapping starts there


# ------------------------------------------------------------------------ writer-only copies


def test_non_writer_engine_acknowledges_host_writes_without_copying():
    dev = [torch.full((8 * 4, 32), 5, dtype=torch.uint8) for _ in range(2)]
    host = [torch.zeros((6 * 4, 32), dtype=torch.uint8) for _ in range(2)]
    engine = TransferEngine(dev, host, 4, writes_host=False)
    engine.spill(1, [2], [3])
    engine.mirror(2, [0, 9], [1, 2])
    host[0][5 * 4:6 * 4] = 7
    engine.restore(3, [5], [6])  # host -> device runs on every rank
    report = engine.poll()
    assert report.enqueued == [1, 2, 3] and report.completed == [1, 2, 3] and not report.failed
    assert report.bytes_to_host == 0 and report.bytes_to_device == 4 * 2 * 32
    assert engine.num_skipped_host_writes == 2
    assert all(bool((h[:5 * 4] == 0).all()) for h in host), "a non-writer wrote the host pool"
    assert bool((dev[0][6 * 4:7 * 4] == 7).all())
    # Injected failures still fail (every rank reports every id).
    failing = TransferEngine(dev, host, 4, writes_host=False, fail_transfer=lambda t: t == 4)
    failing.spill(4, [1], [1])
    assert [t for t, _ in failing.poll().failed] == [4]


def _two_ranks(writer_device: str, shm_dir: str, reader_device: str | None = None):
    name = new_name()
    writer_out, reader_out = CTX.Queue(), CTX.Queue()
    done, go = CTX.Event(), CTX.Event()
    reader = CTX.Process(target=procs.reader_rank,
                         args=(reader_device or writer_device,
                               spec(shm_dir, name, False, open_timeout_s=120), reader_out, go))
    writer = CTX.Process(target=procs.writer_rank,
                         args=(writer_device, spec(shm_dir, name, True), writer_out, done))
    reader.start()  # first: it waits for the writer's segment
    writer.start()
    try:
        _, completed, bytes_to_host, mode = get(writer_out, 300)
        assert completed == [1, 2]
        assert bytes_to_host == procs.L * (3 * procs.BS + 3) * procs.ROW_BYTES
        go.set()  # the scheduler has every rank's completion: the host copy is valid
        _, acked, reader_bytes_to_host, skipped, physical, bad = get(reader_out, 300)
        assert acked == [1, 2], "the reader acknowledges the spill and the mirror"
        assert reader_bytes_to_host == 0 and skipped == 2 and physical == 0.0
        assert bad == [], bad
        done.set()
        _, exists = get(writer_out, 120)
        assert not exists
    finally:
        go.set()
        done.set()
        reader.join(120)
        writer.join(120)
    assert reader.exitcode == 0 and writer.exitcode == 0
    if writer_device.startswith("cuda"):
        assert mode in ("hugetlb", "thp", "pinned")


def test_two_ranks_writer_spills_reader_restores_and_gathers_cpu(shm_dir):
    _two_ranks("cpu", shm_dir)


@pytest.mark.gpu
def test_two_ranks_writer_spills_reader_restores_and_gathers_cuda():
    """Two processes on cuda:0: pinned shared memory registered in each, the writer's
    spill/mirror kernels, the reader's restore/gather kernels; exact bytes."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="hisparse-test-", dir=root)
    try:
        _two_ranks("cuda:0", path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_ranks_on_two_gpus_writer_spills_reader_restores_and_gathers():
    """As vLLM runs TP 2: the writer process on cuda:0, the reader process on cuda:1, each
    registering its own mapping of the one segment; the reader's restore and gather kernels
    on cuda:1 read exactly what the writer's kernels on cuda:0 copied."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="hisparse-test-", dir=root)
    try:
        _two_ranks("cuda:0", path, reader_device="cuda:1")
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------ hostile and broken files

OTHER_UID = 54321
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _plant(shm_dir: str, name: str, body: bytes = b"\0" * 4096, mode: int = 0o600) -> str:
    path = os.path.join(shm_dir, shm_segment.SEGMENT_PREFIX + name)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, mode)
    os.write(fd, body)
    os.close(fd)
    os.chmod(path, mode)
    return path


@needs_root
def test_a_segment_planted_by_another_user_is_refused(shm_dir):
    name = new_name()
    path = _plant(shm_dir, name)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(shm_segment.SegmentError, match=rf"refusing shared segment {path}: it is "
                       rf"owned by uid {OTHER_UID}, this process runs as uid 0"):
        HostPool(*GEOMETRY, pin=False,
                 shared=SharedSegment(**spec(shm_dir, name, False, open_timeout_s=60)))
    with pytest.raises(shm_segment.SegmentError, match=rf"owned by uid {OTHER_UID}"):
        HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, True)))
    assert os.path.exists(path), "another user's file is never removed"


def test_a_segment_others_can_access_is_refused(shm_dir):
    name = new_name()
    path = _plant(shm_dir, name, mode=0o666)
    with pytest.raises(shm_segment.SegmentError, match=r"has mode 0666; segments are created 0600"):
        HostPool(*GEOMETRY, pin=False,
                 shared=SharedSegment(**spec(shm_dir, name, False, open_timeout_s=60)))
    os.unlink(path)
    os.symlink("/etc/passwd", path)
    with pytest.raises(shm_segment.SegmentError, match=r"cannot be opened"):
        HostPool(*GEOMETRY, pin=False,
                 shared=SharedSegment(**spec(shm_dir, name, False, open_timeout_s=60)))


@needs_root
def test_stale_cleanup_skips_other_users_files(shm_dir, caplog):
    foreign = _plant(shm_dir, "someone-else", mode=0o644)
    os.chown(foreign, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.INFO, logger="vllm_hisparse.worker"):
        pool = HostPool(*GEOMETRY, pin=False,
                        shared=SharedSegment(**spec(shm_dir, new_name(), True)))
    pool.close()
    assert os.path.exists(foreign)
    assert f"leaving {foreign} alone: it is owned by uid {OTHER_UID}" in caplog.text


def test_racing_creators_never_both_publish(shm_dir):
    """The check-then-publish race, made deterministic: a second creator publishes the name
    while the first is between its check and its publication (pinning, in ``on_mapped``)."""
    name = new_name()
    inner: list[shm_segment.Segment] = []

    def second_creator_wins(segment):
        inner.append(shm_segment.create_segment(name, 4096, {}, huge_pages="never",
                                                dirs=(shm_dir,)))
        return None

    with pytest.raises(shm_segment.SegmentError, match="was published by another process"):
        shm_segment.create_segment(name, 4096, {}, huge_pages="never", dirs=(shm_dir,),
                                   on_mapped=second_creator_wins)
    (winner,) = inner
    path = os.path.join(shm_dir, shm_segment.SEGMENT_PREFIX + name)
    assert os.stat(path).st_ino == winner.inode, "the loser must not replace the winner's file"
    assert os.listdir(shm_dir) == [os.path.basename(path)], "the loser's temp file is gone"
    winner.unlink()
    winner.mapping.close()
    winner.close_file()


@pytest.mark.slow  # two real processes; test_racing_creators_never_both_publish is the fast twin
def test_two_creator_processes_racing_one_name(shm_dir):
    name = new_name()
    go, release, out = CTX.Event(), CTX.Event(), CTX.Queue()
    racers = [CTX.Process(target=procs.race_create, args=(shm_dir, name, go, out, release))
              for _ in range(2)]
    for p in racers:
        p.start()
    try:
        go.set()
        results = sorted(get(out)[0] for _ in racers)
        assert results == ["published", "refused"]
    finally:
        release.set()
        for p in racers:
            p.join(60)
    assert os.listdir(shm_dir) == []


def _header(**fields) -> bytes:
    import json
    import struct

    header = dict(data_offset=shm_segment.DATA_OFFSET, data_bytes=4096, creator_pid=1,
                  page_mode="small")
    header.update(fields)
    body = json.dumps(header).encode()
    return b"vllm-hisparse-v1" + struct.pack("<Q", len(body)) + body


def _raw(length: int, body: bytes) -> bytes:
    import struct

    return b"vllm-hisparse-v1" + struct.pack("<Q", length) + body


@pytest.mark.parametrize(("body", "why"), [
    (b"", "shorter than the 24 B header prefix"),
    (b"vllm-hisparse", "shorter than the 24 B header prefix"),
    (b"vllm-hisparse-v2" + b"\0" * 64, "bad magic"),
    (_raw(1 << 40, b"{}"), "runs past"),
    (_raw(5, b"{oops"), "not JSON"),
    (_raw(3, b"\xff\xfe{"), "not JSON"),
    (_raw(2, b"[]"), "a JSON list, not an object"),
    (_raw(2, b"{}"), "data_offset=None"),
    (_header(data_offset="2097152"), "data_offset='2097152'"),
    (_header(data_offset=4096), "data_offset=4096, this version uses 2097152"),
    (_header(creator_pid=True), "creator_pid=True"),
    (_header(data_bytes=-1), "data_bytes=-1"),
    (_header(page_mode="gigantic"), "page_mode='gigantic'"),
])
def test_malformed_headers_are_segment_errors(shm_dir, body, why):
    import fcntl

    name = new_name()
    path = _plant(shm_dir, name, body)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live "creator": the opener reads the header
    try:
        with pytest.raises(shm_segment.SegmentError, match="not a valid host pool segment") as err:
            shm_segment.open_segment(name, 4096, {}, dirs=(shm_dir,), timeout_s=5)
        assert why in str(err.value)
    finally:
        os.close(fd)


def test_killed_engine_segment_is_reclaimed_at_next_start(shm_dir, caplog):
    import signal

    name = new_name()
    out, release = CTX.Queue(), CTX.Event()
    engine = CTX.Process(target=procs.create_and_hold,
                         args=(spec(shm_dir, name, True), GEOMETRY, 3, out, release))
    engine.start()
    _, path, _, _ = get(out)
    old_inode = os.stat(path).st_ino
    os.kill(engine.pid, signal.SIGKILL)
    engine.join(60)
    assert engine.exitcode == -signal.SIGKILL and os.path.exists(path)
    with caplog.at_level(logging.WARNING, logger="vllm_hisparse.worker"):
        pool = HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, True)))
    assert f"removed stale shared segment {path}" in caplog.text
    assert f"(creator pid {engine.pid}): its memory is reclaimed" in caplog.text
    assert pool.segment_path == path and os.stat(path).st_ino != old_inode
    pool.close()
    assert os.listdir(shm_dir) == []


def test_read_only_opener_maps_read_only(shm_dir):
    name = new_name()
    with pytest.raises(ValueError, match="creating rank cannot map it read-only"):
        SharedSegment(**spec(shm_dir, name, True, read_only=True))
    creator = HostPool(*GEOMETRY, pin=False, shared=SharedSegment(**spec(shm_dir, name, True)))
    creator.buffer[:8] = 5
    reader = HostPool(*GEOMETRY, pin=False,
                      shared=SharedSegment(**spec(shm_dir, name, False, read_only=True)))
    assert bool((reader.buffer[:8] == 5).all())
    with pytest.raises(TypeError, match="readonly"):
        reader._mapping[shm_segment.DATA_OFFSET] = 1
    start = f"{reader.buffer.data_ptr() - shm_segment.DATA_OFFSET:x}-"
    with open("/proc/self/maps") as f:
        perms = [line.split()[1] for line in f if line.startswith(start)]
    assert perms == ["r--s"], perms  # the creator's own mapping in this process is rw-s
    reader.close()
    creator.close()


def test_memory_usage_counts_a_shared_pool_once(shm_dir):
    """``HostPool.memory_usage``: measured pages, not the geometry. A private pool holds
    what it touched; two mappings of one segment hold it once (their Pss add up to the
    file's pages) while each maps all of it."""
    geometry = (2, 64, 16, 656)  # 1.3 MB
    private = HostPool(*geometry, huge_pages="never", pin=False)
    private.buffer.fill_(1)  # (the allocator may hand out pages already present)
    touched = private.memory_usage()
    assert not touched["shared"] and touched["segment_bytes"] == -1
    assert 0 <= touched["resident_bytes"] - touched["logical_bytes"] < 2 * 4096
    assert touched["pss_bytes"] == touched["resident_bytes"]
    private.close()
    with pytest.raises(RuntimeError, match="closed"):
        private.memory_usage()
    name = new_name()
    creator = HostPool(*geometry, pin=False, shared=SharedSegment(**spec(shm_dir, name, True)))
    reader = HostPool(*geometry, pin=False,
                      shared=SharedSegment(**spec(shm_dir, name, False, read_only=True)))
    reader.buffer.sum()  # fault every page in this mapping too
    mine, theirs = creator.memory_usage(), reader.memory_usage()
    for usage in (mine, theirs):
        assert usage["shared"] and 0 <= usage["resident_bytes"] - usage["logical_bytes"] < 8192
    assert mine["segment_bytes"] == theirs["segment_bytes"] >= mine["logical_bytes"]
    assert abs(mine["pss_bytes"] + theirs["pss_bytes"] - mine["segment_bytes"]) <= 8192
    reader.close()
    creator.close()
