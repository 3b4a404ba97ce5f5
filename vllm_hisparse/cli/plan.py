"""``vllm-hisparse plan``: size a deployment before starting it.

For a model geometry (a preset or custom numbers), the HBM given to KV, the host RAM given to
the pool and the contexts to serve, it prints the decode concurrency with full residency and
with hybrid residency (steady state and at admission), the host memory that concurrency needs,
the host→GPU traffic per decoded token at a given miss rate against the link (and how much of
it IndexShare prefetch can at best take off the step's critical path), the recommended
``device_buffer_size`` and ``host_pool_gib``, and the ``--kv-transfer-config`` to paste.

All figures are per data-parallel replica (one attention replica: the KV it holds and the
requests it serves). The concurrency figures come from the function behind the connector's
startup table (``core.capacity.concurrency_report``) over the layout vLLM's planner makes with the
connector configured (our KV cache group split, its block size, the host block of every
sparse-MLA and indexer layer, the admission window): for the same engine, ``plan`` and the
startup table print the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math

from vllm_hisparse.cli.args import fraction, nonneg_int, output_path, positive_float, positive_int
from vllm_hisparse.cli.output import write_json
from vllm_hisparse.core.capacity import (
    INDEXER_ROW_BYTES,
    PRESETS,
    ModelGeometry,
    concurrency_report,
    critical_path_layers,
    default_device_buffer_size_rows,
    layout_for_geometry,
)
from vllm_hisparse.core.host_layout import choose_host_layout
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, GIB

MB = 1e6
#: Below this concurrency gain plan does not recommend the connector: a few more requests do
#: not pay for the misses' host→GPU traffic on every step.
MIN_GAIN = 1.1


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="size a deployment: concurrency, host GiB, I/O, config",
                       description=__doc__)
    p.add_argument("--model", default="deepseek-v3.2", choices=sorted(PRESETS) + ["custom"],
                   help="geometry preset, or 'custom' with --layers etc. (default: %(default)s)")
    p.add_argument("--layers", type=positive_int, help="custom: sparse-MLA layers")
    p.add_argument("--indexer-layers", type=nonneg_int, help="custom: layers holding indexer keys "
                   "(default: all; fewer with IndexShare)")
    p.add_argument("--row-bytes", type=positive_int, help="custom: bytes of one token's KV in one layer "
                   "(656 fp8_ds_mla, 1152 bf16)")
    p.add_argument("--indexer-row-bytes", type=positive_int, default=INDEXER_ROW_BYTES,
                   help="custom: bytes of one token's indexer key (default: %(default)s)")
    p.add_argument("--block-size", type=positive_int, default=64)
    p.add_argument("--top-k", type=positive_int, default=2048)
    p.add_argument("--kv-gib", type=positive_float, default=60.0,
                   help="HBM given to KV per replica; read it from vLLM's startup log "
                        "(default: %(default)s)")
    p.add_argument("--host-gib", type=positive_float, default=384.0,
                   help="host RAM the pool may pin per replica (default: %(default)s)")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[8192, 32768, 131072],
                   metavar="TOKENS", help="context lengths to plan for (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, metavar="TOKENS",
                   help="vLLM's max_num_batched_tokens, the prefill in flight per request at "
                        "admission (default: %(default)s, vllm serve's on an H100/H200)")
    p.add_argument("--spec-tokens", type=nonneg_int, default=0,
                   help="speculative tokens per step (MTP); sizes the hot region")
    p.add_argument("--device-buffer-size", type=positive_int,
                   help="hot rows per request (default: (spec tokens + 2) * top_k, page aligned)")
    p.add_argument("--miss-rate", type=fraction, default=0.05,
                   help="fraction of selections read from host (see `replay`; default 0.05)")
    p.add_argument("--link-gbs", type=positive_float, default=40.0,
                   help="host→GPU bandwidth for scattered rows, GB/s (default: %(default)s, "
                        "measured zero-copy gather of 656 B rows on H200 PCIe Gen5)")
    p.add_argument("--json", metavar="PATH", type=output_path, help="write the plan as JSON")


def _geometry(args) -> ModelGeometry:
    if args.model != "custom":
        for name in ("layers", "indexer_layers", "row_bytes"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} is only for --model custom; "
                                 f"--model {args.model} fixes it")
        base = PRESETS[args.model]
        if args.block_size != base.block_size or args.top_k != base.top_k:
            base = dataclasses.replace(base, block_size=args.block_size, top_k=args.top_k)
        return base
    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "row_bytes")
               if getattr(args, n) is None]
    if missing:
        raise ValueError(f"--model custom needs {' and '.join(missing)}")
    return ModelGeometry("custom", args.layers, args.block_size, args.row_bytes,
                         args.indexer_row_bytes, args.top_k, num_indexer_layers=args.indexer_layers)


def _check(args) -> None:
    # Signs, finiteness and ranges are checked by each flag's type while parsing.
    if args.row_bytes is not None and args.row_bytes % 16:
        raise ValueError(f"--row-bytes must be a multiple of 16 (the copy kernels move 16 B "
                         f"words), got {args.row_bytes}")


def make_plan(args) -> dict:
    _check(args)
    geo = _geometry(args)
    if args.device_buffer_size is not None:
        hot_rows = args.device_buffer_size
        if hot_rows % geo.block_size:
            raise ValueError(f"--device-buffer-size must be a multiple of the block size "
                             f"{geo.block_size}, got {hot_rows}")
        if hot_rows < (args.spec_tokens + 1) * geo.top_k:
            raise ValueError(f"--device-buffer-size {hot_rows} cannot hold one step's "
                             f"selections ({args.spec_tokens + 1} tokens x top_k {geo.top_k})")
    else:
        hot_rows = default_device_buffer_size_rows(geo, args.spec_tokens + 1)
    if hot_rows > 32768:
        raise ValueError(f"the hot region would be {hot_rows} rows; at most 32768 are supported "
                         f"(int16 LRU)")
    layout = layout_for_geometry(geo, device_kv_bytes=int(args.kv_gib * GIB),
                                 host_pool_bytes=int(args.host_gib * GIB),
                                 device_buffer_size_rows=hot_rows,
                                 admission_window_tokens=args.max_num_batched_tokens)
    bytes_per_decoded_token = (args.spec_tokens + 1) * geo.top_k * args.miss_rate * \
        geo.num_sparse_layers * geo.row_bytes
    exposed_layers = critical_path_layers(geo)
    rows = []
    for context in args.contexts:
        c = concurrency_report(layout, context)
        pages = math.ceil(context / geo.block_size)
        host_needed_gib = c.max_concurrency_steady_device * pages * geo.host_block_bytes / GIB
        io_ms = c.max_concurrency_steady * bytes_per_decoded_token / (args.link_gbs * 1e9) * 1e3
        full_only = c.max_concurrency_without_residency
        rows.append(dict(
            context_tokens=context, full_only=full_only, hybrid_steady=c.max_concurrency_steady,
            hybrid_at_admission=c.max_concurrency_at_admission, steady_limited_by=(
                "host" if c.max_concurrency_host < c.max_concurrency_steady_device else "device"),
            gain=(c.max_concurrency_steady / full_only) if full_only else None,
            host_gib_for_device_limit=host_needed_gib,
            io_ms_per_step_at_steady=io_ms,
            io_ms_per_step_critical_path_at_best=io_ms * exposed_layers / geo.num_sparse_layers,
        ))
        rows[-1]["not_recommended_because"] = _why_not(rows[-1], c, args, geo, hot_rows,
                                                       pages * geo.host_block_bytes / GIB)
    winners = [r for r in rows if r["not_recommended_because"] is None]
    recommended_host_gib = kv_transfer_config = None
    if winners:  # sized for the longest context where the connector pays
        worst = max(winners, key=lambda r: r["context_tokens"])
        recommended_host_gib = math.ceil(min(args.host_gib, max(
            worst["host_gib_for_device_limit"],
            math.ceil(worst["context_tokens"] / geo.block_size) * geo.host_block_bytes / GIB)))
        extra = {"host_pool_gib": recommended_host_gib}
        if args.device_buffer_size is not None or args.spec_tokens:
            extra["device_buffer_size"] = hot_rows
        kv_transfer_config = {"kv_connector": "HiSparseResidencyConnector",
                              "kv_role": "kv_both", "kv_connector_extra_config": extra}
    # The largest index group: a leader and the IndexShare followers up to the next leader.
    group_layers = -(-geo.num_sparse_layers // max(1, geo.indexer_layers))
    host_layout = choose_host_layout("auto", [group_layers],
                                     layout.host_blocks * geo.block_size * geo.row_bytes)
    return dict(
        host_layout=host_layout.layout, host_layout_reason=host_layout.reason,
        model=geo.name, layers=geo.num_sparse_layers, indexer_layers=geo.indexer_layers,
        row_bytes=geo.row_bytes, block_size=geo.block_size, top_k=geo.top_k,
        kv_gib=args.kv_gib, host_gib=args.host_gib, host_blocks=layout.host_blocks,
        host_block_bytes=layout.host_block_bytes, device_blocks=layout.device_blocks,
        bytes_per_block=layout.bytes_per_block, num_sparse_groups=layout.num_sparse_groups,
        num_indexer_groups=layout.num_indexer_groups,
        max_num_batched_tokens=args.max_num_batched_tokens, device_buffer_size=hot_rows,
        device_bytes_per_token_full=geo.device_full_bytes_per_token,
        device_bytes_per_token_hybrid=geo.device_indexer_bytes_per_token,
        host_bytes_per_token=geo.host_bytes_per_token,
        io_bytes_per_decoded_token=bytes_per_decoded_token,
        link_tokens_per_s=(args.link_gbs * 1e9 / bytes_per_decoded_token
                           if bytes_per_decoded_token else None),
        miss_rate=args.miss_rate, link_gbs=args.link_gbs, contexts=rows,
        critical_path_layers=exposed_layers,
        recommended=bool(winners), min_gain=MIN_GAIN,
        recommended_host_pool_gib=recommended_host_gib, kv_transfer_config=kv_transfer_config,
    )


def _why_not(row: dict, c, args, geo: ModelGeometry, hot_rows: int,
             host_gib_per_request: float) -> str | None:
    """Why the connector does not pay at this context (None: it does)."""
    context = row["context_tokens"]
    if row["hybrid_steady"] == 0:
        if c.max_concurrency_steady_device == 0:
            return (f"no {context}-token request fits in --kv-gib {args.kv_gib:g}, even with "
                    f"hybrid residency")
        return (f"--host-gib {args.host_gib:g} holds no whole {context}-token request "
                f"({host_gib_per_request:.1f} GiB each)")
    gain = row["gain"]
    if gain is None or gain >= MIN_GAIN:  # None: only hybrid residency fits a request
        return None
    if row["steady_limited_by"] == "host":
        return (f"the host pool limits hybrid residency to {row['hybrid_steady']} requests "
                f"(full residency: {row['full_only']}, gain {gain:.2f}x < {MIN_GAIN}x); "
                f"--host-gib {math.ceil(row['host_gib_for_device_limit'])} would lift it")
    resident_rows = hot_rows + ACTIVE_TAIL_PAGES * geo.block_size
    return (f"the hot region and tail ({resident_rows} rows) are too close to the whole "
            f"{context}-token context: hybrid residency frees too little HBM (gain "
            f"{gain:.2f}x < {MIN_GAIN}x)")


def run(args) -> int:
    plan = make_plan(args)
    print(f"{plan['model']}: {plan['layers']} sparse layers ({plan['indexer_layers']} with an "
          f"indexer), {plan['row_bytes']} B rows, block {plan['block_size']}, top-k "
          f"{plan['top_k']}; KV {plan['kv_gib']:g} GiB HBM, host {plan['host_gib']:g} GiB "
          f"({plan['host_blocks']} blocks); hot region {plan['device_buffer_size']} rows")
    print(f"KV cache groups: {plan['num_sparse_groups']} sparse-MLA + {plan['num_indexer_groups']} "
          f"indexer, {plan['device_blocks']:,} blocks of {plan['bytes_per_block']:,} B; admission "
          f"window {plan['max_num_batched_tokens']} tokens")
    print(f"per token: device {plan['device_bytes_per_token_full']} B full, "
          f"{plan['device_bytes_per_token_hybrid']} B hybrid (indexer keys); host "
          f"{plan['host_bytes_per_token']} B (sparse-MLA and indexer rows)")
    print(f"host pool layout (host_layout auto): {plan['host_layout_reason']}")
    print()
    print("| context | full residency | hybrid, steady | hybrid, at admission | limited by "
          "| gain | host GiB for device limit | I/O ms/step at steady "
          "| of which on the critical path, at best |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in plan["contexts"]:
        print(f"| {r['context_tokens']} | {r['full_only']} | {r['hybrid_steady']} "
              f"| {r['hybrid_at_admission']} | {r['steady_limited_by']} | {_gain(r['gain'])} "
              f"| {r['host_gib_for_device_limit']:.0f} | {r['io_ms_per_step_at_steady']:.2f} "
              f"| {r['io_ms_per_step_critical_path_at_best']:.2f} |")
    print()
    print(f"I/O per decoded token at {100 * plan['miss_rate']:g} % misses: "
          f"{plan['io_bytes_per_decoded_token'] / MB:.2f} MB; a {plan['link_gbs']:g} GB/s link "
          f"sustains {plan['link_tokens_per_s'] or float('inf'):.0f} tokens/s of misses")
    if plan["critical_path_layers"] < plan["layers"]:
        print(f"IndexShare prefetch: the copies of {plan['critical_path_layers']} of "
              f"{plan['layers']} layers (each group's first launch) stay on the critical path; "
              f"the rest can run under compute (H200 benchmark: docs/benchmarks.md)")
    else:
        print("every layer runs its own indexer: no copy can be prefetched, all I/O is on the "
              "critical path")
    for r in plan["contexts"]:
        if plan["recommended"] and r["not_recommended_because"]:
            print(f"at {r['context_tokens']} tokens the connector does not pay: "
                  f"{r['not_recommended_because']}")
    if not plan["recommended"]:
        print("not recommended: the connector does not pay at any of these contexts:")
        for r in plan["contexts"]:
            print(f"  {r['context_tokens']} tokens: {r['not_recommended_because']}")
        print("serve without it (plain vLLM), or plan for longer contexts")
    else:
        print(f"recommended: host_pool_gib = {plan['recommended_host_pool_gib']}, "
              f"device_buffer_size = {plan['device_buffer_size']}")
        print()
        print("--kv-transfer-config '" + json.dumps(plan["kv_transfer_config"]) + "'")
    if args.json and not write_json("--json", args.json, plan, command="plan"):
        return 1
    return 0


def _gain(gain: float | None) -> str:
    return "n/a (no full request fits)" if gain is None else f"{gain:.1f}x"
