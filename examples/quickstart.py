"""moe_dispatcher in one page: route tokens to experts, dispatch them to the ranks that hold those experts, run
the experts there, combine the results back, and check them.

    torchrun --standalone --nproc_per_node 2 examples/quickstart.py    # CPUs: gloo ranks, the reference backend
    torchrun --standalone --nproc_per_node 4 examples/quickstart.py    # GPUs: NCCL, the compiled kernels

Each rank holds T tokens of hidden size H and E / R of the E experts (expert e lives on rank e // (E / R)).
A toy expert e multiplies a row by (1 + e / E). The combined output of token t must equal
sum_k topk_weights[t, k] * x[t] * (1 + topk_idx[t, k] / E), which each rank checks on its own tokens.
"""
import os

import torch
import torch.distributed as dist

import moe_dispatcher as deep_ep

T, H, TOPK, EXPERTS_PER_RANK = 128, 512, 4, 4


def main() -> None:
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    group = dist.group.WORLD
    num_experts = EXPERTS_PER_RANK * num_ranks

    # One Buffer per group, sized for rows of H bf16 values (2 bytes each). On CPUs the reference backend
    # serves the calls (it warns once that the compiled kernels are not in use).
    num_nvl_bytes = max(config.get_nvl_buffer_size_hint(H * 2, num_ranks)
                        for config in (deep_ep.Buffer.get_dispatch_config(num_ranks),
                                       deep_ep.Buffer.get_combine_config(num_ranks)))
    buffer = deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes)

    # Routing: each token picks its top-k experts; the weights are a softmax over the picked scores.
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn(T, H, generator=gen, device=device).to(torch.bfloat16)
    scores = torch.randn(T, num_experts, generator=gen, device=device)
    top_scores, topk_idx = scores.topk(TOPK, dim=-1)           # topk_idx: int64 [T, K]
    topk_weights = top_scores.softmax(dim=-1).float()           # float32 [T, K]

    # Dispatch: every token goes once to each rank that holds one of its experts.
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, tokens_per_local_expert, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    # recv_x [N, H]: the rows this rank received; recv_topk_idx [N, K]: their picks among this rank's experts
    # (local ids, -1 for experts elsewhere); recv_topk_weights [N, K]: the matching weights (0 elsewhere).

    # The experts: each received row, through each of its local experts, weighted, summed per row.
    rows = recv_x.float()
    y = torch.zeros_like(rows)
    for k in range(TOPK):
        local = recv_topk_idx[:, k]
        picked = local >= 0
        global_expert = (rank * EXPERTS_PER_RANK + local).float()
        scale = torch.where(picked, recv_topk_weights[:, k] * (1 + global_expert / num_experts), 0.0)
        y += rows * scale[:, None]

    # Combine: each row goes back to its token's rank, where the rows of a token are summed.
    out, _, _ = buffer.combine(y.to(torch.bfloat16), handle)    # [T, H] bf16

    expected = (x.float()[:, None, :] * (topk_weights * (1 + topk_idx.float() / num_experts))[:, :, None]).sum(1)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    received = [0] * num_ranks
    dist.all_gather_object(received, int(recv_x.shape[0]))
    if rank == 0:
        print(f"quickstart OK: {num_ranks} ranks ({handle.backend} backend over {dist.get_backend()}), "
              f"{T} tokens each, top-{TOPK} of {num_experts} experts; rows received per rank {received}; "
              f"tokens per local expert on rank 0 {tokens_per_local_expert}")
    buffer.destroy()
    dist.barrier()  # every rank is done with the group before any rank tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
