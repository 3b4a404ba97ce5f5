"""Exploration (not committed): sparse MLA decode kernel variants x configs on the GPU."""
import sys, time, itertools
import torch, triton, triton.language as tl
sys.path.insert(0, ".")
from vllm_hisparse.cli.benchmarks.mla_decode import MlaRowLayout, sparse_mla_decode_reference

@triton.jit
def kern(q_ptr, kv_u8_ptr, kv_bf16_ptr, kv_f32_ptr, idx_ptr, out_ptr, top_k, rows_per_split, sm_scale,
         HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, ROW_BYTES: tl.constexpr,
         ROPE_AT: tl.constexpr, FP8: tl.constexpr, GROUPED: tl.constexpr, Q_IN_LOOP: tl.constexpr,
         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    dg = tl.arange(0, 128)
    dn = tl.arange(0, NOPE)
    dr = tl.arange(0, ROPE)
    token_head = b.to(tl.int64) * HEADS + heads
    q_at = q_ptr + token_head[:, None] * (NOPE + ROPE)
    if not Q_IN_LOOP:
        if GROUPED:
            q0 = tl.load(q_at + 0 + dg[None, :]); q1 = tl.load(q_at + 128 + dg[None, :])
            q2 = tl.load(q_at + 256 + dg[None, :]); q3 = tl.load(q_at + 384 + dg[None, :])
        else:
            qn = tl.load(q_at + dn[None, :])
        qr = tl.load(q_at + NOPE + dr[None, :])
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    if GROUPED:
        a0 = tl.zeros((BLOCK_H, 128), tl.float32); a1 = tl.zeros((BLOCK_H, 128), tl.float32)
        a2 = tl.zeros((BLOCK_H, 128), tl.float32); a3 = tl.zeros((BLOCK_H, 128), tl.float32)
    else:
        acc = tl.zeros((BLOCK_H, NOPE), tl.float32)
    start = split * rows_per_split
    stop = tl.minimum(start + rows_per_split, top_k)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + b.to(tl.int64) * top_k + n, mask=n < stop, other=-1)
        valid = idx >= 0
        row = tl.where(valid, idx, 0).to(tl.int64)
        if Q_IN_LOOP:
            if GROUPED:
                q0 = tl.load(q_at + 0 + dg[None, :]); q1 = tl.load(q_at + 128 + dg[None, :])
                q2 = tl.load(q_at + 256 + dg[None, :]); q3 = tl.load(q_at + 384 + dg[None, :])
            else:
                qn = tl.load(q_at + dn[None, :])
            qr = tl.load(q_at + NOPE + dr[None, :])
        kr = tl.load(kv_bf16_ptr + row[:, None] * (ROW_BYTES // 2) + ROPE_AT // 2 + dr[None, :], mask=valid[:, None], other=0.0)
        if GROUPED:
            if FP8:
                sc = kv_f32_ptr + row * (ROW_BYTES // 4) + NOPE // 4
                base8 = kv_u8_ptr + row[:, None] * ROW_BYTES + dg[None, :]
                k0 = (tl.load(base8, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(sc, mask=valid, other=0.0)[:, None]).to(tl.bfloat16)
                k1 = (tl.load(base8 + 128, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(sc + 1, mask=valid, other=0.0)[:, None]).to(tl.bfloat16)
                k2 = (tl.load(base8 + 256, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(sc + 2, mask=valid, other=0.0)[:, None]).to(tl.bfloat16)
                k3 = (tl.load(base8 + 384, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(sc + 3, mask=valid, other=0.0)[:, None]).to(tl.bfloat16)
            else:
                base16 = kv_bf16_ptr + row[:, None] * (ROW_BYTES // 2) + dg[None, :]
                k0 = tl.load(base16, mask=valid[:, None], other=0.0); k1 = tl.load(base16 + 128, mask=valid[:, None], other=0.0)
                k2 = tl.load(base16 + 256, mask=valid[:, None], other=0.0); k3 = tl.load(base16 + 384, mask=valid[:, None], other=0.0)
            s = tl.dot(q0, tl.trans(k0)); s = tl.dot(q1, tl.trans(k1), s); s = tl.dot(q2, tl.trans(k2), s)
            s = tl.dot(q3, tl.trans(k3), s); s = tl.dot(qr, tl.trans(kr), s)
        else:
            if FP8:
                raw = tl.load(kv_u8_ptr + row[:, None] * ROW_BYTES + dn[None, :], mask=valid[:, None], other=0)
                scale = tl.load(kv_f32_ptr + row[:, None] * (ROW_BYTES // 4) + NOPE // 4 + tl.arange(0, 4)[None, :], mask=valid[:, None], other=0.0)
                grouped = tl.reshape(raw.to(tl.float8e4nv, bitcast=True).to(tl.float32), (BLOCK_N, 4, NOPE // 4))
                kn = tl.reshape(grouped * scale[:, :, None], (BLOCK_N, NOPE)).to(tl.bfloat16)
            else:
                kn = tl.load(kv_bf16_ptr + row[:, None] * (ROW_BYTES // 2) + dn[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(qn, tl.trans(kn)); s = tl.dot(qr, tl.trans(kr), s)
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - base)
        p = tl.exp(s - base[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        pb = p.to(tl.bfloat16)
        if GROUPED:
            a0 = tl.dot(pb, k0, a0 * alpha[:, None]); a1 = tl.dot(pb, k1, a1 * alpha[:, None])
            a2 = tl.dot(pb, k2, a2 * alpha[:, None]); a3 = tl.dot(pb, k3, a3 * alpha[:, None])
        else:
            acc = tl.dot(pb, kn, acc * alpha[:, None])
        m = m_new
    inv = 1.0 / tl.where(denom > 0, denom, 1.0)
    o_at = out_ptr + (token_head * tl.num_programs(2) + split)[:, None] * NOPE
    if GROUPED:
        tl.store(o_at + dg[None, :], (a0 * inv[:, None]).to(tl.bfloat16))
        tl.store(o_at + 128 + dg[None, :], (a1 * inv[:, None]).to(tl.bfloat16))
        tl.store(o_at + 256 + dg[None, :], (a2 * inv[:, None]).to(tl.bfloat16))
        tl.store(o_at + 384 + dg[None, :], (a3 * inv[:, None]).to(tl.bfloat16))
    else:
        tl.store(o_at + dn[None, :], (acc * inv[:, None]).to(tl.bfloat16))

def rows_for(L, n, dev):
    rows = torch.zeros(n, L.row_bytes, dtype=torch.uint8, device=dev)
    nope = torch.randn(n, L.nope_dim, device=dev)
    if L.fp8:
        rows[:, :512] = nope.to(torch.float8_e4m3fn).view(torch.uint8)
        rows[:, 512:528] = (torch.rand(n, 4, device=dev) + 0.5).view(torch.uint8)
    else:
        rows[:, :1024] = nope.bfloat16().view(torch.uint8)
    rows[:, L.rope_offset_bytes:L.used_bytes] = torch.randn(n, 64, device=dev).bfloat16().view(torch.uint8)
    return rows

def time_it(fn, reps=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return min(ts)

dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(dev).multi_processor_count
configs = [(16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (32, 64, 8, 2), (64, 32, 8, 2),
           (64, 64, 8, 2), (64, 32, 8, 1), (64, 16, 8, 2), (64, 32, 4, 2)]
variants = [(g, qil) for g in (False, True) for qil in (False, True)]
budget_s = float(sys.argv[1]) if len(sys.argv) > 1 else 150
t_start = time.time()
for name, L, H, B in (("dsv32", MlaRowLayout(512, 64, True, 656), 128, 90),
                      ("glm", MlaRowLayout(512, 64, False, 1152), 64, 90)):
    K = 2048
    t_start = time.time()
    rows = rows_for(L, 300_000, dev)
    q = torch.randn(B, H, 576, device=dev).bfloat16()
    idx = torch.randint(0, 300_000, (B, K), device=dev, dtype=torch.int32)
    ref = sparse_mla_decode_reference(q[:4], rows, idx[:4], L, 0.07)
    flops = 2 * B * H * K * (576 + 512)
    best = {}
    for (grp, qil), (bh, bn, w, st) in itertools.product(variants, configs):
        if time.time() - t_start > budget_s:
            print("budget spent", flush=True); break
        for S in sorted({1, max(1, min(8, -(-2 * SMS // (B * H // bh))))}):
            out = torch.empty(B * H * S * 512, device=dev, dtype=torch.bfloat16)
            def run():
                return kern[(B, H // bh, S)](q, rows, rows.view(torch.bfloat16), rows.view(torch.float32), idx, out, K, -(-K // S), 0.07,
                            HEADS=H, NOPE=512, ROPE=64, ROW_BYTES=L.row_bytes, ROPE_AT=L.rope_offset_bytes,
                            FP8=L.fp8, GROUPED=grp, Q_IN_LOOP=qil, BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=st)
            try:
                t0 = time.time(); h = run(); torch.cuda.synchronize(); ct = time.time() - t0
                ms = time_it(run)
            except Exception as ex:
                print(f"{name} grp={grp:d} qil={qil:d} {bh},{bn},{w},{st} S={S}: {type(ex).__name__} {str(ex)[:100]}", flush=True)
                continue
            err = float("nan")
            if S == 1:
                err = (out.view(B, H, 512)[:4].float() - ref).abs().max().item()
            regs, spills = getattr(h, "n_regs", "?"), getattr(h, "n_spills", "?")
            print(f"{name} grp={grp:d} qil={qil:d} BH={bh} BN={bn} w={w} st={st} S={S}: {ms*1e3:7.1f} us "
                  f"{flops / ms / 1e9:6.0f} TFLOPS regs={regs} spills={spills} err={err:.3g} compile={ct:.1f}s", flush=True)
            best[(grp, qil, bh, bn, w, st, S)] = ms
    top = sorted(best.items(), key=lambda kv: kv[1])[:5]
    print(name, "best:", [(k, round(v * 1e3, 1)) for k, v in top], flush=True)
    # torch unfused (the old stand-in's work): index_select + matmul + softmax + matmul
    kvq = torch.randn(K, 576, device=dev).bfloat16(); sel = torch.empty(B * K, L.row_bytes, dtype=torch.uint8, device=dev)
    qq = q.view(B * H, 576); sc = torch.empty(B * H, K, device=dev, dtype=torch.bfloat16); oo = torch.empty(B * H, 512, device=dev, dtype=torch.bfloat16)
    def old():
        torch.index_select(rows, 0, idx.view(-1).long(), out=sel)
        torch.matmul(qq, kvq.t(), out=sc); p = torch.softmax(sc, 1); torch.matmul(p, kvq[:, :512], out=oo)
    ms = time_it(old)
    print(f"{name} old unfused stand-in: {ms*1e3:.1f} us {flops/ms/1e9:.0f} TFLOPS", flush=True)
