"""Low-latency buffer layout and the dedup dispatch's index math, on CPU.

* get_low_latency_rdma_size_hint is the layout's total and never exceeds DeepEP V1's formula, and the dedup
  staging and flags fit the layout (read from its one definition, csrc/kernels/low_latency/layout.h, through the
  CPU module moe_dispatcher._layout).
* The per-rank combine's partial rows, routing and flags fit the same layout.
* A model of what the dedup kernels compute (dispatch_dedup_send.cuh: slots, message indices, picks grouped
  by destination; dispatch_dedup_recv.cuh: placement and expansion) lands every (source, token, expert)
  exactly where the reference backend puts it.
"""
from __future__ import annotations

import itertools

import torch

from moe_dispatcher.buffer import Buffer
from moe_dispatcher.runtime import ll_layout

MAX_TOPK = ll_layout.max_topk()


def deepep_v1_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """DeepEP V1's low-latency buffer size (its LowLatencyLayout: two halves of send + receive + signal regions,
    combine messages with per-128-channel scales), written from its documented layout."""
    scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = num_experts * max_tokens * max(dispatch_msg, combine_msg)
    signal = (num_experts * 4 + 127) // 128 * 128
    return (2 * (send + recv + signal) + 127) // 128 * 128


def half_layout(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> dict:
    """The C++ half_layout (layout.h) with the region sizes the checks below read."""
    lay = ll_layout.half_layout(max_tokens, hidden, num_ranks, num_experts)
    signal_words = lay["signal_bytes"] // 4
    return {"send": lay["recv_off"] - lay["send_off"], "recv": lay["signal_off"] - lay["recv_off"],
            "signal_words": signal_words, "flags_words": signal_words - num_experts, "msg": lay["msg_bytes"],
            "dedup_slot": lay["dedup_slot_bytes"], "half": lay["half_bytes"]}


SHAPES = [(t, h, r, r * local)
          for t, h, r, local in itertools.product([1, 3, 8, 128, 256, 1024, 4096], [128, 384, 512, 2048, 7168, 16384],
                                                  [1, 2, 3, 4, 8, 32], [1, 2, 3, 8, 32, 64, 256])
          if r * local <= 1024]


def test_hint_never_above_deepep_and_matches_layout():
    for t, h, r, e in SHAPES:
        hint = Buffer.get_low_latency_rdma_size_hint(t, h, r, e)
        assert hint == 2 * half_layout(t, h, r, e)["half"], (t, h, r, e)
        assert hint <= deepep_v1_hint(t, h, r, e), (t, h, r, e, hint, deepep_v1_hint(t, h, r, e))


def test_dedup_staging_and_flags_fit():
    for t, h, r, e in SHAPES:
        if e // r < 2:
            continue  # the dedup dispatch is not used with one expert per rank
        lay = half_layout(t, h, r, e)
        assert r * t * lay["dedup_slot"] <= lay["recv"], (t, h, r, e)
        assert lay["flags_words"] >= r + r * t, (t, h, r, e)  # message counts + [R][maxT] flags
        # the picks {n, p...} of up to min(K, L) experts fit after the largest body
        assert lay["msg"] + 4 * (1 + min(MAX_TOPK, e // r)) <= lay["dedup_slot"]


def test_per_rank_combine_rows_and_routing_fit():
    """The per-rank combine's partial rows [R][maxT][H] bf16 and the routing [R][maxT][K] int2 (K up to 32) fit
    the receive region, and its flags [R] + [R][maxT] the signal words, whenever it is used (L >= 2)."""
    for t, h, r, e in SHAPES:
        if e // r < 2:
            continue  # one expert per rank: the per-expert combine
        lay = half_layout(t, h, r, e)
        assert r * t * 2 * h + r * t * MAX_TOPK * 8 <= lay["recv"], (t, h, r, e)
        assert lay["flags_words"] >= r + r * t, (t, h, r, e)


def _sender(topk: torch.Tensor, num_ranks: int, local: int, max_tokens: int):
    """What one source rank's dedup send phase writes: counts[e], messages[d], and per destination d the list of
    messages (index i -> (token, picks)), picks grouped as plan_destinations groups them."""
    t_count, k = topk.shape
    counts = [0] * (num_ranks * local)
    messages = [0] * num_ranks
    out = {d: {} for d in range(num_ranks)}
    for t in range(t_count):
        # counting pass limited to the entries before token t: slots and message indices (count_earlier)
        slot = [0] * k
        stage = [0] * num_ranks
        row = [int(v) for v in topk[t]]
        for i in range(t * k):
            e = int(topk.view(-1)[i])
            if e < 0:
                continue
            for kk in range(k):
                if row[kk] == e:
                    slot[kk] += 1
                    break
            first = all(int(topk.view(-1)[j]) < 0 or int(topk.view(-1)[j]) // local != e // local
                        for j in range(i - i % k, i))
            if first:
                stage[e // local] += 1
        # plan_destinations: destinations in first-pick order, picks grouped, k ascending inside a group
        dests = []
        for e in row:
            if e >= 0 and e // local not in dests:
                dests.append(e // local)
        for d in dests:
            picks = [(e % local) * max_tokens + slot[kk] for kk, e in enumerate(row) if e >= 0 and e // local == d]
            assert stage[d] not in out[d], "two messages in one slot"
            out[d][stage[d]] = (t, picks)
            messages[d] += 1
        for e in row:
            if e >= 0:
                counts[e] += 1
    for d in range(num_ranks):
        assert sorted(out[d]) == list(range(messages[d])), "message indices are not 0..n-1"
    return counts, messages, out




def test_dedup_model_matches_reference_placement():
    g = torch.Generator().manual_seed(3)
    for num_ranks, local, k, max_tokens in [(4, 64, 8, 16), (2, 16, 6, 9), (3, 2, 2, 7), (4, 8, 8, 12)]:
        e_total = num_ranks * local
        tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=g)) for _ in range(num_ranks)]
        topks = []
        for t in tokens:
            idx = torch.rand(t, e_total, generator=g).topk(k, dim=1).indices
            idx[torch.rand(t, k, generator=g) < 0.2] = -1
            topks.append(idx)
        sent = [_sender(topks[s], num_ranks, local, max_tokens) for s in range(num_ranks)]
        rt = num_ranks * max_tokens
        for me in range(num_ranks):
            # receiver: placement from the counts, then the expansion of every message
            cnt = [[sent[s][0][me * local + l] for s in range(num_ranks)] for l in range(local)]
            begin = [[sum(cnt[l][:s]) for s in range(num_ranks)] for l in range(local)]
            src_info = {}
            for s in range(num_ranks):
                assert sent[s][1][me] == len(sent[s][2][me])
                for tok, picks in sent[s][2][me].values():
                    for p in picks:
                        l, sl = divmod(p, max_tokens)
                        flat = l * rt + begin[l][s] + sl
                        assert flat not in src_info, "two picks on one row"
                        src_info[flat] = (s, tok)
            # reference: expert l holds sources ascending, then tokens ascending
            want = {}
            for l in range(local):
                r0 = 0
                for s in range(num_ranks):
                    for tok in range(tokens[s]):
                        if (topks[s][tok] == me * local + l).any():
                            want[l * rt + r0] = (s, tok)
                            r0 += 1
                assert r0 == sum(cnt[l])
            assert src_info == want
