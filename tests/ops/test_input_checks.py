"""Input checks of the data-plane ops (issue 13, defect 6), across backends.

CPU: the data checks the CUDA backend runs under ``HISPARSE_CHECK_INPUTS=1`` (functions of
``ops/_checks.py``) accept every valid case and reject every defect with the reference's error.
GPU twins (``-m gpu``): the kernel reports ``CORRUPT_LRU`` exactly when the reference raises it,
the debug checks raise before launch, and the metadata checks (aliasing, meta) always run.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from resolve_cases import (ResolveCase, adversarial_cases, call_copy, copy_defect_cases, i32,
                           input_defect_cases, random_case)
from vllm_hisparse import ops
from vllm_hisparse.ops import _checks, errors, reference
from vllm_hisparse.ops.errors import ResolveError, ResolveErrorCode

DEFECTS = list(input_defect_cases())
ADVERSARIAL = list(adversarial_cases())
COPY_DEFECTS = list(copy_defect_cases())
DEBUG_ONLY = {"lru slot twice"}  # every other lru defect the kernel reports by itself


def _values(case: ResolveCase) -> tuple:
    return case.args()[:8]


def _same_error(a: Exception, b: Exception) -> None:
    assert type(a) is type(b) and str(a) == str(b)


# --------------------------------------------------------------------------------------
# the debug path's checks on CPU tensors
# --------------------------------------------------------------------------------------


def test_value_checks_follow_the_environment(monkeypatch):
    monkeypatch.delenv(_checks.CHECK_INPUTS_ENV, raising=False)
    assert not _checks.value_checks_enabled()
    monkeypatch.setenv(_checks.CHECK_INPUTS_ENV, "0")
    assert not _checks.value_checks_enabled()
    monkeypatch.setenv(_checks.CHECK_INPUTS_ENV, "1")
    assert _checks.value_checks_enabled()


@pytest.mark.parametrize("name,case,error,code,text", DEFECTS, ids=[c[0] for c in DEFECTS])
def test_debug_checks_raise_what_the_reference_raises(name, case, error, code, text):
    with pytest.raises(error) as debug:
        _checks.check_resolve_values(*_values(case))
    with pytest.raises(error) as ref:
        reference.resolve(*case.args())
    _same_error(debug.value, ref.value)


@pytest.mark.parametrize("seed", range(100))
def test_debug_checks_accept_random_valid_cases(seed):
    case = random_case(random.Random(90_000 + seed))
    _checks.check_resolve_values(*_values(case))


@pytest.mark.parametrize("name,case", ADVERSARIAL, ids=[c[0] for c in ADVERSARIAL])
def test_debug_checks_accept_adversarial_valid_cases(name, case):
    _checks.check_resolve_values(*_values(case))


@pytest.mark.parametrize("seed", range(100))
def test_debug_lru_check_fires_exactly_when_the_reference_does(seed):
    """A valid case with one row's lru broken: the debug check (a vectorised "does the
    request select a non-resident page") and the reference agree on raising and on the error."""
    rng = random.Random(95_000 + seed)
    case = random_case(rng)
    row = rng.randrange(case.lru.shape[0])
    case.lru[row, rng.randrange(case.lru.shape[1])] = rng.choice([-1, case.lru.shape[1], 400])
    try:
        reference.resolve(*case.clone().args())
        ref_error = None
    except ResolveError as e:
        ref_error = e
    if ref_error is None:
        _checks.check_resolve_values(*_values(case))
        return
    assert ref_error.code == ResolveErrorCode.CORRUPT_LRU
    with pytest.raises(ResolveError) as debug:
        _checks.check_resolve_values(*_values(case))
    _same_error(debug.value, ref_error)


@pytest.mark.parametrize("name,op,ids,error,text", COPY_DEFECTS, ids=[c[0] for c in COPY_DEFECTS])
def test_copy_debug_checks_raise_what_the_reference_raises(name, op, ids, error, text):
    src = [torch.zeros((64, 32), dtype=torch.uint8) for _ in range(2)]
    dst = [torch.zeros((40, 32), dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(error) as debug:
        call_copy(_checks_backend(), op, src, dst, ids)
    with pytest.raises(error) as ref:
        call_copy(reference, op, src, dst, ids)
    _same_error(debug.value, ref.value)


class _checks_backend:
    """The copy ops' debug checks under the ops' own names."""

    gather_rows = staticmethod(_checks.check_gather_values)
    copy_blocks = staticmethod(_checks.check_block_copy_values)
    mirror_rows = staticmethod(_checks.check_row_copy_values)


# --------------------------------------------------------------------------------------
# GPU twins
# --------------------------------------------------------------------------------------


@pytest.fixture
def cuda_ops():
    if not torch.cuda.is_available():  # pragma: no cover - CPU CI (conftest skips too)
        pytest.skip("needs a CUDA device")
    module = pytest.importorskip("vllm_hisparse.ops.cuda")
    if not module.available():  # pragma: no cover
        pytest.skip("vllm_hisparse._C has no data-plane kernels")
    try:
        module.check_errors()  # no record left over from another test
    except ResolveError:
        pass
    return module


@pytest.fixture
def debug_checks(monkeypatch):
    monkeypatch.setenv(_checks.CHECK_INPUTS_ENV, "1")


@pytest.fixture
def no_debug_checks(monkeypatch):
    monkeypatch.delenv(_checks.CHECK_INPUTS_ENV, raising=False)


def _lru_cases():
    for name, case, _, code, _ in DEFECTS:
        if code is not None and name not in DEBUG_ONLY:
            yield name, case
    second_defects = (
        ("lru and hot block missing", lambda c: c.hot_blocks.__setitem__((0, 0), -1)),
        ("lru and duplicate slot", lambda c: c.slot_pos.__setitem__((0, 5), 12)),
        ("lru and bad position", lambda c: c.topk.__setitem__((0, 1), 40)))
    for name, mutate in second_defects:
        case = next(c for n, c, *_ in input_defect_cases() if n == "lru value D")
        mutate(case)
        yield name, case


LRU_CASES = list(_lru_cases())


@pytest.mark.gpu
@pytest.mark.parametrize("name,case", LRU_CASES, ids=[c[0] for c in LRU_CASES])
def test_gpu_kernel_reports_the_references_lru_error(cuda_ops, no_debug_checks, name, case):
    """Without the debug checks: same code, row and details, on the same condition."""
    with pytest.raises(ResolveError) as ref:
        reference.resolve(*case.clone().args())
    gpu = case.clone("cuda")
    ops.select("cuda").resolve(*gpu.args())
    with pytest.raises(ResolveError) as kernel:
        cuda_ops.check_errors()
    _same_error(kernel.value, ref.value)
    assert torch.equal(gpu.lru.cpu(), case.lru) and torch.equal(gpu.slot_pos.cpu(), case.slot_pos)


@pytest.mark.gpu
def test_gpu_kernel_ignores_the_lru_of_a_fully_resident_request(cuda_ops, no_debug_checks):
    case = next(c for n, c, *_ in input_defect_cases() if n == "lru value D")
    case.topk = i32([[30, 29, -1, 28]])
    ref = case.clone()
    reference.resolve(*ref.args())
    gpu = case.clone("cuda")
    ops.select("cuda").resolve(*gpu.args())
    cuda_ops.check_errors()
    for key, value in ref.state().items():
        assert torch.equal(gpu.state()[key], value), key


@pytest.mark.gpu
@pytest.mark.parametrize("name,case,error,code,text", DEFECTS, ids=[c[0] for c in DEFECTS])
def test_gpu_debug_checks_raise_before_launch(cuda_ops, debug_checks, name, case, error, code,
                                              text):
    gpu = case.clone("cuda")
    before = gpu.state()
    with pytest.raises(error, match=re.escape(text)):
        ops.select("cuda").resolve(*gpu.args())
    cuda_ops.check_errors()  # nothing was launched, nothing recorded
    for key, value in gpu.state().items():
        assert torch.equal(value, before[key]), f"{key} was written"


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(50))
def test_gpu_debug_checks_accept_random_valid_cases(cuda_ops, debug_checks, seed):
    case = random_case(random.Random(97_000 + seed))
    ref, gpu = case.clone(), case.clone("cuda")
    reference.resolve(*ref.args())
    ops.select("cuda").resolve(*gpu.args())
    cuda_ops.check_errors()
    for key in ("out_rows", "miss_count", "slot_pos", "lru", "stats"):
        assert torch.equal(gpu.state()[key], ref.state()[key]), key


@pytest.mark.gpu
@pytest.mark.parametrize("name,case", ADVERSARIAL, ids=[c[0] for c in ADVERSARIAL])
def test_gpu_debug_checks_accept_adversarial_valid_cases(cuda_ops, debug_checks, name, case):
    ref, gpu = case.clone(), case.clone("cuda")
    reference.resolve(*ref.args())
    ops.select("cuda").resolve(*gpu.args())
    cuda_ops.check_errors()
    for key in ("out_rows", "miss_count", "slot_pos", "lru", "stats"):
        assert torch.equal(gpu.state()[key], ref.state()[key]), key


@pytest.mark.gpu
@pytest.mark.parametrize("name,op,ids,error,text", COPY_DEFECTS, ids=[c[0] for c in COPY_DEFECTS])
def test_gpu_copy_debug_checks_raise_the_references_error(cuda_ops, debug_checks, name, op, ids,
                                                          error, text):
    src = [torch.zeros((64, 32), dtype=torch.uint8).pin_memory() for _ in range(2)]
    dst = [torch.zeros((40, 32), dtype=torch.uint8, device="cuda") for _ in range(2)]
    with pytest.raises(error) as ref:
        call_copy(reference, op, [s.clone() for s in src], [d.cpu() for d in dst], ids)
    with pytest.raises(error) as gpu:
        call_copy(ops.select("cuda"), op, src, dst, ids, device="cuda")
    _same_error(gpu.value, ref.value)
    assert all(int(d.count_nonzero()) == 0 for d in dst)


@pytest.mark.gpu
def test_gpu_aliasing_and_meta_are_always_rejected(cuda_ops, no_debug_checks):
    case = next(c for n, c, *_ in input_defect_cases() if n == "residency -2").clone("cuda")
    case.residency[0, 2] = -1
    cuda = ops.select("cuda")
    aliased = case.clone()
    aliased.miss_dst = aliased.miss_src
    with pytest.raises(errors.AliasedOutputError, match="miss_dst shares memory with miss_src"):
        cuda.resolve(*aliased.args())
    meta = case.clone()
    meta.lru = meta.lru.to("meta")
    with pytest.raises(errors.MetaTensorError, match="lru is a meta tensor"):
        cuda.resolve(*meta.args())
    dst = [torch.zeros((40, 32), dtype=torch.uint8, device="cuda")]
    with pytest.raises(errors.AliasedOutputError, match=re.escape("dst_layers[0] shares memory")):
        cuda.mirror_rows(dst, dst, i32([1]).cuda(), i32([2]).cuda())
