"""Where the time of our Megatron dispatcher round trip goes (GPU, torchrun, one process per GPU).

  torchrun --standalone --nproc_per_node 4 tools/profile_round_trip.py      (env H, E, K, T, OUT)

The round trip of one Megatron-Core MoELayer (bench/results/h200x4.md): router + dispatch_preprocess +
token_dispatch + dispatch_postprocess + (h * probs) + combine_preprocess + token_combine +
combine_postprocess, forward and backward, identity experts. Rank 0 writes to $OUT:
  round_trip_profile.txt   the event-timed round trip, host syncs seen in steady state (CUDA sync debug
                           mode warnings + notify waits), and torch.profiler's top ops by CUDA and CPU time;
  round_trip_trace.json.gz the chrome trace of the profiled iterations.
"""
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore")
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
from megatron.core import parallel_state as ps  # noqa: E402

ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.spec_utils import get_submodules  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import moe_dispatcher.integrations.megatron  # noqa: E402,F401  (registers "moe_dispatcher")

model_parallel_cuda_manual_seed(123)
H = int(os.environ.get("H", 7168)); FFN = int(os.environ.get("FFN", 2048)); E = int(os.environ.get("E", 256))
K = int(os.environ.get("K", 8)); T = int(os.environ.get("T", 4096))
OUT = os.environ.get("OUT", ".")
cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=64, num_moe_experts=E, moe_ffn_hidden_size=FFN,
                        ffn_hidden_size=FFN, moe_router_topk=K, moe_token_dispatcher_type="moe_dispatcher",
                        expert_model_parallel_size=world, bf16=True, params_dtype=torch.bfloat16,
                        moe_router_dtype="fp32", add_bias_linear=False, moe_aux_loss_coeff=0.0,
                        moe_router_load_balancing_type="none", gated_linear_unit=True, activation_func=F.silu)
sub = get_submodules(get_gpt_layer_local_submodules(num_experts=E, moe_grouped_gemm=False).mlp)
torch.manual_seed(0)
layer = MoELayer(cfg, sub).cuda()
layer.set_layer_number(0)
x = torch.randn(T, 1, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
d = layer.token_dispatcher


def rt():
    probs, rmap = layer.router(x)
    h, p = d.dispatch_preprocess(x, rmap, probs)
    h, p = d.token_dispatch(h, p)
    h, tpe, pp = d.dispatch_postprocess(h, p)
    h = (h * pp.unsqueeze(-1)).to(x.dtype)
    h = d.combine_preprocess(h)
    h = d.token_combine(h)
    h = d.combine_postprocess(h)
    h.float().sum().backward()


def timed(fn, iters=20):
    torch.cuda.synchronize(); dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    s.record()
    for _ in range(iters):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / iters
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters, host_ms


from moe_dispatcher.integrations.megatron.buffers import _buffers  # noqa: E402
from moe_dispatcher.integrations.megatron.sizing import ROWS_ENV  # noqa: E402

# Sizing variants of the same dispatcher, side by side ($MOE_DISPATCHER_EXPERT_ROWS, sizing.py):
#   bound  fixed M (high-water mark x headroom), no host sync (an overflow would raise two calls later);
#   exact  every dispatch waits for notify's counts (the default).
# The default goes last: the profile below runs it.
VARIANTS = ["bound", "exact"]


def use(variant):
    os.environ[ROWS_ENV] = variant
    return rt


waits = {"n": 0}


def count_notify_waits():
    for _, buf in list(_buffers.values()):
        kernels = getattr(buf, "_kernels", None)
        if kernels is not None and hasattr(kernels, "_wait_counts") and not hasattr(kernels._wait_counts, "counted"):
            inner = kernels._wait_counts

            def counted(*a, _inner=inner, **kw):
                waits["n"] += 1
                return _inner(*a, **kw)
            counted.counted = True
            kernels._wait_counts = counted


def host_syncs(fn, iters=3):
    """Host syncs per iteration in steady state: notify waits (the intranode backend's only host wait) plus
    the synchronising torch ops CUDA's sync debug mode reports."""
    count_notify_waits()
    waits["n"] = 0
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        for _ in range(iters):
            fn()
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    msgs = [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message).lower()
            and "prototype" not in str(w.message)]
    return (waits["n"] + len(msgs)) / iters, waits["n"] / iters, sorted(set(msgs))


results = {}
for variant in VARIANTS:
    fn = use(variant)
    for _ in range(5):  # warm-up (the very first call is synchronised: it seeds the row budget)
        fn()
    gpu_ms, host_ms = timed(fn)
    syncs, notify_waits, msgs = host_syncs(fn)
    rows = d._row_budget.high_water if variant == "exact" else d._row_budget.rows_for(T, K)
    results[variant] = (gpu_ms, host_ms, syncs, notify_waits, msgs, rows)


# The round trip's own work, with no exchange at all: router forward/backward, and the float32 probs multiply
# with its cast to bf16 on as many expert rows as the dispatch hands the experts (the same for every
# dispatcher with exact rows: one per (token, expert) pair; M >= that with fixed rows), forward and backward
# (the permuted probs are an index of the router's probs; the gradient arriving at the multiply is a ready
# bf16 tensor, as combine's backward would hand it over). Every dispatcher's round trip contains this work;
# what is left is the dispatcher's own (exchange, permutation, reduction, bookkeeping) plus the round trip's
# loss on [T, H].
def floor_ms(rows, iters=20):
    h_rows = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    grad_rows = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    pick = torch.randint(0, T * E, (rows,), device="cuda")

    def floor_rt():
        probs, _ = layer.router(x)
        hh = h_rows.requires_grad_()
        pp = probs.reshape(-1)[pick]
        y = (hh * pp.unsqueeze(-1)).to(x.dtype)
        y.backward(grad_rows)
        hh.grad = None  # no accumulation across calls (the real round trip hands this gradient on)
    for _ in range(3):
        floor_rt()
    torch.cuda.synchronize(); dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        floor_rt()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


floors = {name: floor_ms(r[-1]) for name, r in results.items()}  # per variant: the same calls on every rank
x.grad = None
profiled = use(VARIANTS[-1])  # the profile below: the default (exact sizing)

from torch.profiler import ProfilerActivity, profile  # noqa: E402

torch.cuda.synchronize(); dist.barrier()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        profiled()
    torch.cuda.synchronize()
if rank == 0:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "round_trip_profile.txt"), "w") as f:
        f.write(f"EP={world} T={T} H={H} E={E} top{K} bf16: our dispatcher round trip (fwd+bwd, identity experts)\n")
        f.write("  floor: the round trip's own work on the M expert rows (router + float32 probs multiply, fwd+bwd, "
                "no exchange); own share = round trip - floor\n")
        for name, (gpu_ms, host_ms, syncs, notify_waits, msgs, rows) in results.items():
            f.write(f"  {name:16s} M {rows:6d} | round trip GPU {gpu_ms:.3f} ms/iter (events), floor {floors[name]:.3f}, "
                    f"own share {gpu_ms - floors[name]:.3f} ms | host enqueue {host_ms:.3f} ms/iter | host syncs/iter "
                    f"{syncs:.2f} "
                    f"(notify waits {notify_waits:.2f}){' | ' + '; '.join(msgs) if msgs else ''}\n")
        f.write("\n=== top ops by CUDA time (5 iterations) ===\n")
        try:
            f.write(prof.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=60))
        except Exception:  # older torch
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        f.write("\n=== top ops by CPU time (5 iterations) ===\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    import gzip, shutil
    prof.export_chrome_trace("/tmp/round_trip_trace.json")
    with open("/tmp/round_trip_trace.json", "rb") as src, gzip.open(os.path.join(OUT, "round_trip_trace.json.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    print(open(os.path.join(OUT, "round_trip_profile.txt")).read()[:6000], flush=True)
ps.destroy_model_parallel()
dist.destroy_process_group()
