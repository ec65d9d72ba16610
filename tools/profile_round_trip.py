"""Where the time of our Megatron dispatcher round trip goes (GPU, torchrun, one process per GPU).

  torchrun --standalone --nproc_per_node 4 tools/profile_round_trip.py      (env H, E, K, T, OUT)

The round trip is the yardstick's (shared/tools/megatron_layer_bench.py): router + dispatch_preprocess +
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


def timed(iters=20):
    torch.cuda.synchronize(); dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    s.record()
    for _ in range(iters):
        rt()
    host_ms = (time.perf_counter() - t0) * 1e3 / iters
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters, host_ms


for _ in range(5):  # warm-up: the first call is synchronised (it seeds the row budget)
    rt()
gpu_ms, host_ms = timed()

# The yardstick's own work, with no exchange at all: router forward/backward, and the float32 probs multiply
# with its cast to bf16 on as many expert rows as our dispatch produced (the same for every dispatcher: one row
# per (token, expert) pair), forward and backward (the permuted probs are an index of the router's probs; the
# gradient arriving at the multiply is a ready bf16 tensor, as combine's backward would hand it over). Every
# dispatcher's round trip contains this work; what is left is the dispatcher's own (exchange, permutation,
# reduction, bookkeeping) plus the yardstick's loss on [T, H].
with torch.no_grad():
    probs0, rmap0 = layer.router(x)
    h0, p0 = d.dispatch_preprocess(x, rmap0, probs0)
    h0, p0 = d.token_dispatch(h0, p0)
    h0, _, pp0 = d.dispatch_postprocess(h0, p0)
    rows = h0.shape[0]
    h_rows = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    grad_rows = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    pick = torch.randint(0, T * E, (rows,), device="cuda")
del h0, p0, pp0


def floor_rt():
    probs, _ = layer.router(x)
    hh = h_rows.requires_grad_()
    pp = probs.reshape(-1)[pick]
    y = (hh * pp.unsqueeze(-1)).to(x.dtype)
    y.backward(grad_rows)
    hh.grad = None  # no accumulation across calls (the real round trip hands this gradient on)


def timed_floor(iters=20):
    for _ in range(3):
        floor_rt()
    torch.cuda.synchronize(); dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        floor_rt()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


floor_ms = timed_floor()

# Host syncs in steady state: CUDA's sync debug mode flags synchronising torch ops; notify waits (the only
# host wait of the intranode backend) are counted on the Buffer's backend.
from moe_dispatcher.integrations.megatron.buffers import _buffers  # noqa: E402

waits = {"n": 0}
for _, buf in list(_buffers.values()):
    kernels = getattr(buf, "_kernels", None)
    if kernels is not None and hasattr(kernels, "_wait_counts"):
        inner = kernels._wait_counts

        def counted(*a, _inner=inner, **kw):
            waits["n"] += 1
            return _inner(*a, **kw)
        kernels._wait_counts = counted
torch.cuda.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(3):
        rt()
    torch.cuda.set_sync_debug_mode("default")
torch.cuda.synchronize()
sync_msgs = sorted({str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message).lower()})

from torch.profiler import ProfilerActivity, profile  # noqa: E402

torch.cuda.synchronize(); dist.barrier()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        rt()
    torch.cuda.synchronize()
if rank == 0:
    os.makedirs(OUT, exist_ok=True)
    budget = d._row_budget
    with open(os.path.join(OUT, "round_trip_profile.txt"), "w") as f:
        f.write(f"EP={world} T={T} H={H} E={E} top{K} bf16: our dispatcher round trip (fwd+bwd, identity experts)\n")
        f.write(f"  GPU {gpu_ms:.3f} ms/iter (events), host enqueue {host_ms:.3f} ms/iter\n")
        f.write(f"  yardstick floor (router + float32 probs multiply on {rows} rows, fwd+bwd, no exchange): "
                f"{floor_ms:.3f} ms/iter; the dispatcher's own share: {gpu_ms - floor_ms:.3f} ms\n")
        f.write(f"  expert rows: high-water {budget.high_water}, headroom {budget.headroom}, next M "
                f"{budget.rows_for(T, K)}\n")
        f.write(f"  steady state: {waits['n']} notify waits in 3 iterations; {len(sync_msgs)} distinct "
                f"synchronising torch ops:\n")
        for m in sync_msgs:
            f.write(f"    {m}\n")
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
