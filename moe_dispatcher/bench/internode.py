"""Internode (two-hop) normal mode beside the intranode kernels and NCCL, on the same GPUs and routing.

`python -m moe_dispatcher.bench --mode internode --nvl-size 2 --backend kernels` on 4 GPUs: emulated 2 domains
x 2 GPUs (MOE_DISPATCHER_NVL_SIZE semantics, given here as a Topology); with --num-pool-bytes N both Buffers get a
peer pool (the internode one: its NVLink hop writes straight into the domain peers' outputs, and its combine,
whose inputs the Workload allocates in the pool, pulls the domain's rows in place). Byte counts (bench/README.md):
NVL bytes = recv_x rows x H x 2 (logical; physical = rows from other ranks); RDMA bytes = (token, destination
domain) pairs x H x 2 sent by this rank (physical = pairs to other domains). On one host the "RDMA" hop is an
NVSHMEM put over NVLink (P2P transport): real cross-node figures cannot be measured here.
"""
from __future__ import annotations

from typing import Any, Dict

from ..buffer import Buffer
from ..topology import Topology
from .common import Context, fmt_rec
from .normal import Workload, _release, cached_cases, nccl_baselines, nvl_bytes, plot_config


def run(ctx: Context) -> None:
    o, r = ctx.opts, ctx.num_ranks
    nvl = o.nvl_size or max(1, r // 2)
    if r % nvl or r // nvl < 2:
        ctx.note(f"internode bench needs --nvl-size dividing {r} ranks into >= 2 domains, got {nvl}")
        return
    dcfg, ccfg = plot_config(o, r)
    configs = [dcfg, ccfg]
    hb = o.hidden * 2
    nvl_b = nvl_bytes(configs, o.hidden, r)
    rdma_b = max(c.get_rdma_buffer_size_hint(hb, r, nvl) for c in configs)
    ctx.say(f"== internode normal mode: {r} ranks as {r // nvl} domains x {nvl}, T={o.tokens} H={o.hidden} "
            f"top-{o.topk} of {o.num_experts}, sms={dcfg.num_sms}; RDMA buffer {rdma_b / 2 ** 20:.0f} MiB")
    # --num-pool-bytes: both Buffers get a peer pool (intranode: direct dispatch and pull combine; internode: the
    # NVLink hop's direct dispatch and pull combine; the Workload puts the combine inputs in the pool), so the
    # comparison is pool against pool.
    intra = Buffer(ctx.group, num_nvl_bytes=nvl_b, backend=o.backend, topology=Topology(ctx.rank, r, r),
                   num_pool_bytes=o.num_pool_bytes)
    inter = Buffer(ctx.group, num_nvl_bytes=nvl_b, num_rdma_bytes=rdma_b, backend=o.backend,
                   topology=Topology(ctx.rank, r, nvl), num_pool_bytes=o.num_pool_bytes)
    try:
        results: Dict[str, Dict[str, Any]] = {}
        nccl = None
        for name, buf in (("intranode", intra), ("internode", inter)):
            w = Workload(ctx, buf, o.tokens, seed=1)  # same seed: same routing and data for both
            recv_x, h0 = w.fresh(dcfg)
            w.learn(recv_x, h0)
            if nccl is None:
                nccl = nccl_baselines(ctx, w, o.iters, o.warmup)
                for key, rec in nccl.items():
                    ctx.say(f"[nccl] all_to_all_single {key:13s}: {fmt_rec(rec)}")
                ctx.records.extend(nccl.values())
            ctx.say(f"  {name}: backend {h0.backend}")
            recs = cached_cases(ctx, w, h0, dcfg, ccfg, o.iters, o.warmup, nccl, name, f"{name} tuned")
            if name == "internode":
                in_domain = w.layout[3].view(w.tokens, r // nvl, nvl).any(-1)
                pairs = int(in_domain.sum())
                remote = pairs - int(in_domain[:, ctx.rank // nvl].sum())
                nvl_log, nvl_phys = w.bytes_bf16()
                for rec in recs:
                    f = (1 + 4 / 128) / 2 if rec.get("dtype") == "fp8" else 1.0
                    rec.update(nvl_bytes=nvl_log * f, nvl_physical_bytes=nvl_phys * f,
                               rdma_bytes=pairs * hb * f, rdma_physical_bytes=remote * hb * f, nvl_size=nvl)
                ctx.say(f"  rank {ctx.rank}: NVL bytes {nvl_log / 1e6:.1f} MB (physical {nvl_phys / 1e6:.1f}), "
                        f"RDMA bytes {pairs * hb / 1e6:.1f} MB (physical, other domains: {remote * hb / 1e6:.1f}) "
                        f"per BF16 call")
            for rec in recs:
                results[f"{name} {rec['op']} {rec['dtype']}"] = rec
            ctx.records.extend(recs)
            counters = getattr(getattr(buf, "_kernels", None), "_ipc", None)
            if o.num_pool_bytes and hasattr(counters, "path_counters"):
                direct, missed, pulls, pulls_missed = counters.path_counters()
                ctx.say(f"  {name} peer pool: {direct - missed} of {direct} dispatches direct, "
                        f"{pulls - pulls_missed} of {pulls} combines pulled")
            del recv_x, h0, w
            _release(ctx.device)
        for op in ("dispatch bf16", "dispatch fp8", "combine bf16"):
            a, b = results.get(f"intranode {op}"), results.get(f"internode {op}")
            if a and b and a["t_us"]["mean"] > 0:
                ratio = b["t_us"]["mean"] / a["t_us"]["mean"]
                ctx.say(f"  {op}: internode {b['t_us']['mean']:.0f} us / intranode {a['t_us']['mean']:.0f} us = "
                        f"{ratio:.2f}x (target <= 1.5x)")
                b["vs_intranode"] = ratio
    finally:
        _release(ctx.device)
        intra.destroy()
        inter.destroy()
