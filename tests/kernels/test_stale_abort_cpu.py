"""A rank that raised in a normal-mode call and is back leaves no stale abort on the Board (2 gloo ranks, CPU).

The real Buffer with the real IntranodeBackend over the intranode stub and the real LowLatencyBackend over the stub
runtime (tests/helpers): a low-latency layout change runs the Board's agreement rounds, as on GPUs.
Each case: rank 1 raises alone in a normal-mode call (a cached dispatch with the wrong token count: the Buffer's
check), both ranks then make one normal-mode call of a kind that never enters the Board, and then a layout change
that rank 1 comes to late (rank 0 waits in its round meanwhile). Rank 1 was back since that call: rank 0 must wait
for it, not raise "rank 1 raised" about the earlier call. The kinds: a cached dispatch and a combine served by their
native plans (the Buffer's fast paths), get_dispatch_layout's native call, a cached dispatch through the full path,
a combine with a bias (always the full path). Before the fix, only a Board collective or a low-latency call cleared
the abort, so rank 0 raised PeerError in the round.
"""
from __future__ import annotations

import time

import torch
from dist import case, run_distributed

TIMEOUT_S = 6.0
ENV = {"MOE_DISPATCHER_TIMEOUT_S": str(TIMEOUT_S)}
T, H, E, K, ROWS, MAXT = 16, 256, 8, 2, 24, 8
LATE_S = 1.5  # how late rank 1 comes to the round: past the two looks POLL_S apart that a peer's abort takes


def _worker(rank: int, num_ranks: int) -> None:
    from stub_extension import attach_stub_backend
    from stub_low_latency import attach_stub_low_latency

    from moe_dispatcher import Buffer, EventOverlap
    buf = Buffer(num_nvl_bytes=1 << 30, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(MAXT, 2 * H, 2, E),
                 low_latency_mode=True, backend="reference", explicitly_destroy=True)
    backend = attach_stub_backend(buf, ROWS)
    rt = attach_stub_low_latency(buf).runtime
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    x = torch.randn(T, H, generator=g).bfloat16()
    handle = backend.dispatch(x, None, idx, None, torch.full((2,), T, dtype=torch.int32),
                              torch.ones(T, 2, dtype=torch.bool), torch.zeros(E, dtype=torch.int32), 1, 0)[5]
    recv = torch.zeros(ROWS, H, dtype=torch.bfloat16)
    buf.dispatch(x, handle=handle)  # the native plans, made by the full path
    buf.combine(recv, handle)
    hidden = H
    buf.low_latency_dispatch(torch.zeros(T // 2, hidden, dtype=torch.bfloat16), idx[:T // 2], MAXT, E, use_fp8=False)
    calls = {
        "cached dispatch (native plan)": lambda: buf.dispatch(x, handle=handle),
        "combine (native plan)": lambda: buf.combine(recv, handle),
        "get_dispatch_layout (native call)": lambda: buf.get_dispatch_layout(idx, E),
        "cached dispatch (full path)": lambda: buf.dispatch(x, handle=handle, previous_event=EventOverlap()),
        "combine with a bias (full path)": lambda: buf.combine(recv, handle, bias=torch.zeros(T, H,
                                                                                            dtype=torch.bfloat16)),
    }
    for what, back in calls.items():
        with case(f"rank 1 raises alone, then both ranks make a {what}, then a layout change rank 1 is late to"):
            if rank == 1:
                try:
                    buf.dispatch(x[:3], handle=handle)
                except ValueError:
                    pass
                else:
                    raise AssertionError("the cached dispatch with 3 tokens did not raise")
                assert buf._board.abort_message(1) is not None, "the abort was not posted"
            back()
            if rank == 1:
                assert buf._board.abort_message(1) is None, f"a {what} left rank 1's abort on the Board"
                said = buf._board.last_abort_message(1)
                assert said is not None and said.startswith("ValueError"), said  # kept for a peer's wording
                time.sleep(LATE_S)  # rank 0 waits in the round meanwhile
            hidden = 3 * H - hidden  # H <-> 2H: a layout change on both ranks
            cleans = len(rt.cleans)
            buf.low_latency_dispatch(torch.zeros(T // 2, hidden, dtype=torch.bfloat16), idx[:T // 2], MAXT, E,
                                     use_fp8=False)
            assert len(rt.cleans) == cleans + 1, rt.cleans
    buf.destroy()


def test_a_rank_back_from_a_normal_mode_error_leaves_no_stale_abort() -> None:
    run_distributed(_worker, 2, env=ENV, timeout=120)
