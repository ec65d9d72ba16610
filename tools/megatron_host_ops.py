"""Host work of one MoE layer's token dispatcher (moe_token_dispatcher_type "moe_dispatcher"), forward and backward,
counted on a CPU machine: torch ops, Python calls and host syncs per dispatcher step.

    python tools/megatron_host_ops.py [--path compiled|compiled-pool|reference|all] [--ops] [--comm-timer]
                                      [--json OUT]

Each step of Megatron's interface (dispatch_preprocess ... combine_postprocess) and the backward of the two
exchanges is run under a TorchDispatchMode that counts every aten op it reaches (launches plus allocations and
views: on a GPU host each costs ~5-10 us of host time) and under sys.setprofile (Python functions and builtins
entered). Host syncs are the calls that wait for the device on a GPU: .item() / int() / bool() of a tensor
(aten._local_scalar_dense), .tolist() / .cpu() / .numpy(), and the compiled backend's wait for notify's counts
(_wait_counts). Not seen: syncs of CUDA-only calls (events, streams), which CPU tensors never reach.

Paths:
  compiled       the real Buffer and IntranodeBackend (the Python of the GPU path) over the stub extension of
                 tests/helpers/stub_extension.py on one rank: the native calls launch nothing, so every op
                 counted is host glue around them (what the GPU host pays besides the ~9 us native calls).
  compiled-pool  the same with a peer pool (direct dispatch into pool blocks, pull combine).
  reference      the reference backend over gloo, 2 ranks (the CPU oracle: its counts are the reference's own
                 work, not what a GPU step does).
The experts are identity (rows times the permuted probs); their ops are left out ("experts"). Backward ops
outside the two exchanges' backward (the router's top-k gather, the probs multiply) are "backward other".
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import types
import warnings

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "helpers")]

H, E, K, T = 256, 8, 4, 64
FORWARD = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess", "token_combine",
           "combine_postprocess")
BACKWARD = ("token_combine.backward", "token_dispatch.backward", "backward other")
SYNC_OPS = ("_local_scalar_dense",)  # item(), int(), float(), bool() of a tensor
HOST_COPIES = ("tolist", "cpu", "numpy")


class Counts:
    """Per phase: aten ops (by name), Python calls, host syncs."""

    def __init__(self) -> None:
        self.phase = "outside"
        self.ops = collections.defaultdict(collections.Counter)
        self.calls = collections.Counter()
        self.syncs = collections.Counter()

    def op(self, name: str) -> None:
        self.ops[self.phase][name] += 1
        if name.split(".")[0] in SYNC_OPS:
            self.syncs[self.phase] += 1


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.counts.op(func.__name__ if hasattr(func, "__name__") else str(func))
        return func(*args, **(kwargs or {}))


def _setup_megatron(world: int) -> None:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    import moe_dispatcher.integrations.megatron  # noqa: F401  (registers the dispatcher types)
    from moe_dispatcher.integrations.megatron import cpu
    cpu.enable()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world,
                                 expert_tensor_parallel_size=1)


def _dispatcher(world: int):
    import torch.nn.functional as F
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_dispatcher.integrations.megatron import MoEDispatcherTokenDispatcher
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
                               moe_ffn_hidden_size=64, ffn_hidden_size=64, moe_router_topk=K,
                               moe_token_dispatcher_type="moe_dispatcher", use_cpu_initialization=True,
                               add_bias_linear=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                               moe_router_dtype="fp32", gated_linear_unit=True, activation_func=F.silu)
    pg = get_default_pg_collection()
    local = E // world
    first = dist.get_rank(pg.ep) * local
    return MoEDispatcherTokenDispatcher(local, list(range(first, first + local)), config=config, pg_collection=pg)


def _attach_stub(d, pool: bool) -> None:
    """Make the dispatcher's Buffer serve CPU tensors with the IntranodeBackend over the stub extension (exact row
    counts: notify reports T * K / 2 received rows, spread over the local experts)."""
    from stub_extension import attach_stub_backend

    from moe_dispatcher import Buffer
    from moe_dispatcher.integrations.megatron import dispatcher
    buf = Buffer(d.group, num_nvl_bytes=1 << 26, backend="reference")
    kernels = attach_stub_backend(buf, rows=T * K // 2)
    mod = kernels._mod
    local = d.num_local_experts
    kernels._ipc.expert_counts = lambda n: [T * K // 2 // n] * n
    kernels._ipc.wait_notify = lambda seq, timeout: (T * K // 2, 0)
    buf._resolve = lambda *args, **kwargs: kernels  # the Buffer would route CPU tensors to the reference
    # The Buffer checks top-k ids by value (three host syncs) only for CPU tensors and the reference backend: leave
    # them out, as on a GPU.
    buf._check_routing = lambda data, backend, *args: _check_routing_as_on_gpu(buf, data, *args)
    if pool:
        kernels.peer_pool = types.SimpleNamespace(mem_pool_id=(0, 1), closed=False)

        def pool_block(ipc, device_index, pool_id, nbytes):
            return torch.empty(max(1 << 21, 1 << (nbytes - 1).bit_length()), dtype=torch.uint8), 0

        def direct_dispatch(ipc, timeout_ns, x, x_scales, topk_idx, topk_weights, in_rank, offsets, send_rows,
                            payload, out_offset, meta, meta_offset, rows, local_, pad_rows, *ring, row_of_token):
            from moe_dispatcher.compiled import recv_tensors
            return recv_tensors(rows, x, x_scales, 0 if x_scales is None else x_scales.shape[1], topk_idx.shape[1])

        mod.pool_block = pool_block
        mod.direct_payload_bytes = lambda rows, row_bytes, scales: rows * row_bytes
        mod.direct_meta_bytes = lambda rows, k: rows * (16 * k + 4)
        mod.direct_dispatch = direct_dispatch
    del local
    dispatcher.get_buffer = lambda *args, **kwargs: buf


def _check_routing_as_on_gpu(buf, data, topk_idx, topk_weights, num_experts) -> None:
    """Buffer._check_routing as it runs for CUDA tensors on the compiled backend (no check by value)."""
    from moe_dispatcher import validation
    if topk_idx is None:
        return
    validation.check_num_experts(num_experts, buf.group_size)
    validation.check_topk_idx(topk_idx, num_experts, num_tokens=data.shape[0], device=data.device, values=False,
                              distinct=True)
    if topk_weights is not None:
        validation.check_topk_weights(topk_weights, topk_idx)


def _layer(d, counts: Counts, rank: int):
    """One forward + backward of the dispatcher around identity experts, counting each phase."""
    from moe_dispatcher import autograd as md_autograd
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(T, 1, H, generator=g).requires_grad_()
    scores = torch.randn(T, E, generator=g).requires_grad_()
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.detach().topk(K, dim=1).indices, True)
    probs = scores.softmax(-1) * routing_map
    upstream = torch.randn(T, 1, H, generator=g)

    def step(name, fn, *args):
        counts.phase = name
        try:
            return fn(*args)
        finally:
            counts.phase = "outside"

    h, p = step("dispatch_preprocess", d.dispatch_preprocess, x, routing_map, probs)
    h, p = step("token_dispatch", d.token_dispatch, h, p)
    rows, tpe, pp = step("dispatch_postprocess", d.dispatch_postprocess, h, p)
    expert_out = step("experts", lambda: rows * pp.unsqueeze(-1))
    out = step("combine_preprocess", d.combine_preprocess, expert_out)
    out = step("token_combine", d.token_combine, out)
    y = step("combine_postprocess", d.combine_postprocess, out)

    originals = {}
    for cls, name in ((md_autograd._ExpertMajorCombine, "token_combine.backward"),
                      (md_autograd._ExpertMajorDispatch, "token_dispatch.backward")):
        originals[cls] = cls.backward

        def wrapped(ctx, *grads, _orig=cls.backward, _name=name):
            counts.phase = _name
            try:
                return _orig(ctx, *grads)
            finally:
                counts.phase = "backward other"
        cls.backward = staticmethod(wrapped)
    try:
        counts.phase = "backward other"
        y.backward(upstream)
    finally:
        counts.phase = "outside"
        for cls, orig in originals.items():
            cls.backward = staticmethod(orig)


def measure(path: str, rank: int = 0, world: int = 1, timed: bool = False) -> Counts:
    """Counts of layer calls after a warm-up one (which makes the Buffer, plans and caches): one call counts torch
    ops and syncs, another (without the counting mode, whose own Python would count) Python calls. timed: with
    the dispatcher's comm_timer on (integrations/megatron/timing.py), as the training driver's timed steps run."""
    from moe_dispatcher.integrations.megatron import comm_timer
    comm_timer.enable(timed)
    _setup_megatron(world)
    d = _dispatcher(world)
    if path != "reference":
        _attach_stub(d, pool=path == "compiled-pool")
    _layer(d, Counts(), rank)  # warm-up
    counts = Counts()
    from moe_dispatcher.integrations.megatron import dispatcher as dispatcher_mod
    buf = dispatcher_mod.get_buffer(d.group, hidden=H, element_size=4, backend=d.buffer_backend)
    if buf._kernels is not None and path != "reference":
        original_wait = buf._kernels._wait_counts

        def counted_wait(seq):
            counts.syncs[counts.phase] += 1
            return original_wait(seq)
        buf._kernels._wait_counts = counted_wait
    # Tensor methods that copy to the host (a sync for a CUDA tensor); item() / int() / bool() are counted as ops.
    originals = {name: getattr(torch.Tensor, name) for name in HOST_COPIES}

    def counted(name):
        def method(self, *args, **kwargs):
            counts.syncs[counts.phase] += 1
            return originals[name](self, *args, **kwargs)
        return method
    for name in HOST_COPIES:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _OpCounter(counts):
            _layer(d, counts, rank)
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    if path != "reference":
        buf._kernels._wait_counts = original_wait

    # Python calls, leaving out this tool's and the stub extension's frames (the stub stands in for native calls).
    skipped = (os.path.abspath(__file__), os.path.join(_ROOT, "tests", "helpers", "stub_extension.py"))

    def prof(frame, event, arg):
        if event in ("call", "c_call") and frame.f_code.co_filename not in skipped:
            counts.calls[counts.phase] += 1
    sys.setprofile(prof)
    try:
        _layer(d, counts, rank)
    finally:
        sys.setprofile(None)
    return counts


def _rank_main(rank: int, world: int, store_path: str, path: str, out: dict, timed: bool = False) -> None:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        counts = measure(path, rank, world, timed)
        if rank == 0:
            out["counts"] = counts
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, store_path: str, path: str, timed: bool, queue) -> None:
    out: dict = {}
    _rank_main(rank, world, store_path, path, out, timed)
    if rank == 0:
        c = out["counts"]
        queue.put(({k: dict(v) for k, v in c.ops.items()}, dict(c.calls), dict(c.syncs)))


def run(path: str, timed: bool = False) -> Counts:
    """Counts of `path` (one rank in this process for the compiled paths, two spawned gloo ranks for the reference)."""
    store_path = tempfile.mktemp(prefix="md_host_ops_")
    if path != "reference":
        out: dict = {}
        _rank_main(0, 1, store_path, path, out, timed)
        return out["counts"]
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, 2, store_path, path, timed, queue)) for r in range(2)]
    for p in procs:
        p.start()
    ops, calls, syncs = queue.get(timeout=600)
    for p in procs:
        p.join()
    counts = Counts()
    for k, v in ops.items():
        counts.ops[k].update(v)
    counts.calls.update(calls)
    counts.syncs.update(syncs)
    return counts


def as_dict(counts: Counts) -> dict:
    """{phase: {"ops": aten ops, "calls": Python calls, "syncs": host syncs}} over FORWARD + BACKWARD."""
    return {phase: {"ops": sum(counts.ops[phase].values()), "calls": counts.calls[phase],
                    "syncs": counts.syncs[phase]} for phase in FORWARD + BACKWARD}


def report(path: str, counts: Counts, show_ops: bool) -> None:
    print(f"{path}: per MoE layer, forward + backward (aten ops / Python calls / host syncs)")
    total = [0, 0, 0]
    for phase in FORWARD + BACKWARD:
        n_ops = sum(counts.ops[phase].values())
        row = (n_ops, counts.calls[phase], counts.syncs[phase])
        total = [a + b for a, b in zip(total, row)]
        print(f"  {phase:24s} {row[0]:5d} {row[1]:6d} {row[2]:3d}")
        if show_ops and n_ops:
            print("      " + ", ".join(f"{name} {n}" for name, n in sorted(counts.ops[phase].items())))
    print(f"  {'total':24s} {total[0]:5d} {total[1]:6d} {total[2]:3d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", choices=("compiled", "compiled-pool", "reference", "all"), default="all")
    ap.add_argument("--ops", action="store_true", help="list the ops of each phase")
    ap.add_argument("--comm-timer", action="store_true",
                    help="with the dispatcher's comm_timer on, as in the training driver's timed steps")
    ap.add_argument("--json", help="write the counts of one --path (not all) to this file")
    opts = ap.parse_args()
    paths = ("compiled", "compiled-pool", "reference") if opts.path == "all" else (opts.path,)
    if opts.json and len(paths) > 1:
        ap.error("--json takes one --path")
    for path in paths:
        if path == "reference" or len(paths) == 1:
            counts = run(path, opts.comm_timer)
            report(path + (", comm_timer on" if opts.comm_timer else ""), counts, opts.ops)
            if opts.json:
                with open(opts.json, "w", encoding="utf-8") as f:
                    json.dump(as_dict(counts), f, indent=1)
        else:  # one rank per process: each compiled path in its own child
            import subprocess
            subprocess.run([sys.executable, __file__, "--path", path] + (["--ops"] if opts.ops else [])
                           + (["--comm-timer"] if opts.comm_timer else []), check=True)


if __name__ == "__main__":
    main()
