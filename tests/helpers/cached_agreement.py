"""Shared by the GPU tests of cached calls whose ranks disagree (tests/kernels/test_cached_agreement_gpu.py,
intranode; test_internode_cached_agreement_gpu.py, internode): the inputs and handle of one exact dispatch, the
run of a list of disagreeing cases (each must raise SignatureMismatch on every rank at the next fresh dispatch,
then leave the Buffer usable) and a run of agreeing cached calls whose layout changes per call alike on every
rank (nothing may be recorded)."""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import pytest
import torch
from agreement_rounds import K, L, T, exact_rows, routing
from dist import case


class CachedAgreement:
    """One rank's Buffer `buf` after a fresh dispatch of exact rows x (float32 [T, H], multiples of 1/16: every sum
    is exact) along a routing that sends token 0 to every rank: recv_x, handle, copies (float32 [T, 1]: the ranks
    each token went to), recv_w (float32 [rows, K]), FP8 rows x8 with unit scales, and `odd` (the last rank, the one
    that disagrees)."""

    def __init__(self, buf, rank: int, num_ranks: int) -> None:
        self.buf, self.rank, self.num_ranks = buf, rank, num_ranks
        self.odd = rank == num_ranks - 1
        self.idx = routing(rank, num_ranks)
        self.idx[0] = torch.tensor([(r % num_ranks) * L + r // num_ranks for r in range(K)])  # to every rank
        self.x = exact_rows(rank)
        self.recv_x, _, _, _, self.handle, _ = self.fresh_dispatch()
        self.copies = self.buf.get_dispatch_layout(self.idx, L * num_ranks)[3].sum(1, keepdim=True).float()
        self.recv_w = torch.rand(self.recv_x.shape[0], K, device="cuda")
        self.scales = torch.ones(T, 4, device="cuda")
        self.x8 = self.x.to(torch.float8_e4m3fn)

    def fresh_dispatch(self):
        lay = self.buf.get_dispatch_layout(self.idx, L * self.num_ranks)
        return self.buf.dispatch(self.x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                 num_tokens_per_expert=lay[2], topk_idx=self.idx)

    def agreeing_round(self) -> None:
        """Cached dispatch and combine along the handle, and a fresh round: exact results."""
        got = self.buf.dispatch(self.x, handle=self.handle)[0]
        assert torch.equal(got, self.recv_x), "cached dispatch after the case gave other rows"
        out, _, _ = self.buf.combine(got, self.handle)
        assert torch.equal(out, self.x * self.copies), "combine after the case gave wrong sums"
        fresh, _, _, _, h2, _ = self.fresh_dispatch()
        assert torch.equal(self.buf.combine(fresh, h2)[0], self.x * self.copies), \
            "the fresh round after the case gave wrong sums"

    def run_cases(self, cases: Sequence[Tuple[str, Callable[[], object], str]], reporters: Sequence[int]) -> List[str]:
        """Each (label, call, pattern): the call moves rows and raises nothing (the receivers record the
        disagreement), cached calls go on (no rank raises alone), the next fresh dispatch raises SignatureMismatch
        matching `pattern` on every rank and names every rank of `reporters` as one that found it; then an agreeing
        round. -> the messages."""
        from moe_dispatcher.signature import SignatureMismatch
        seen = []
        for label, call, pattern in cases:
            with case(label):
                call()
                self.buf.dispatch(self.x, handle=self.handle)
                with pytest.raises(SignatureMismatch, match=pattern) as info:
                    self.fresh_dispatch()  # its notify reports the finding on every rank
                text = str(info.value)
                for r in reporters:
                    assert f"on rank {r}, a cached dispatch or combine" in text, text
                seen.append(f"{label}: {info.value}")
                self.agreeing_round()
        return seen

    def run_agreeing(self, calls: int) -> None:
        """`calls` cached dispatch / combine pairs whose layout changes per call alike on every rank (hidden, FP8,
        top-k weights), so a stale signature of the previous call would be caught: exact sums where checked, and
        nothing recorded."""
        buf, x, handle, recv_w = self.buf, self.x, self.handle, self.recv_w
        with case(f"{calls} agreeing cached calls whose layout changes per call alike on every rank"):
            wide = x.repeat(1, 2)
            for i in range(calls):
                kind = i % 4
                if kind == 0:
                    got = buf.dispatch(x, handle=handle)[0]
                    out, w, _ = buf.combine(got, handle)
                elif kind == 1:
                    got = buf.dispatch(wide, handle=handle)[0]
                    out, w, _ = buf.combine(got, handle, topk_weights=recv_w)
                elif kind == 2:
                    got, _ = buf.dispatch((self.x8, self.scales), handle=handle)[0]
                    out, w, _ = buf.combine(self.recv_x.bfloat16(), handle)
                else:
                    got = buf.dispatch(x.bfloat16(), handle=handle)[0]
                    out, w, _ = buf.combine(got.repeat(1, 2), handle, topk_weights=recv_w)
                if i % 50 == kind:
                    torch.cuda.synchronize()
                    if kind == 0:
                        assert torch.equal(out, x * self.copies), f"call {i}: wrong sums"
                    elif kind == 1:
                        assert torch.equal(out, wide * self.copies), f"call {i}: wrong sums"
                        assert w is not None and w.shape == (T, K)
            torch.cuda.synchronize()
            assert buf._kernels._ipc.take_ring_mismatch() is None, "an agreeing run recorded a disagreement"
            self.agreeing_round()  # its fresh dispatch would raise if a receiver had flagged one

