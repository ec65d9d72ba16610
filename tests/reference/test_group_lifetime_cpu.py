"""moe_dispatcher never keeps a process group alive after destroy_process_group().

A process group that outlives destroy_process_group() (held by a module-level table, say) is torn down during
interpreter exit, after the threads it relies on: gloo's then abort the process at random ("terminate called
without an active exception", SIGABRT) after all its work is done -- a rank that finished its job fails."""
from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist

from moe_dispatcher import Buffer

T, H, E, K = 8, 64, 4, 2


def test_buffers_release_their_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = weakref.ref(dist.group.WORLD)
        for _ in range(2):  # the second Buffer of a group takes a new board ordinal: still no strong hold
            buf = Buffer(backend="reference")
            x = torch.randn(T, H, dtype=torch.bfloat16)
            topk_idx = torch.rand(T, E).argsort(dim=1)[:, :K].contiguous()  # distinct experts per token
            topk_weights = torch.rand(T, K)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                      num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert)
            out, _, _ = buf.combine(recv_x, handle)
            assert out.shape == (T, H)
            del buf, recv_x, handle, out
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert group() is None, ("the process group is still alive after destroy_process_group(): referrers "
                             f"{[type(r).__name__ for r in gc.get_referrers(group())]}")
