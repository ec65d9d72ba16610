"""Pure host-side helpers the compiled backends share (CPU: no kernels involved)."""
from __future__ import annotations

from moe_dispatcher.compiled import timeout_message


def test_timeout_message_names_rank_phase_and_peer():
    msg = timeout_message("intranode", (1, "combine receive", 3, 0), 2.0, "MOE_DISPATCHER_TIMEOUT_S")
    assert msg.startswith("moe_dispatcher intranode: rank 3 timed out after 2 s in combine receive waiting for "
                          "rank 0")
    assert "MOE_DISPATCHER_TIMEOUT_S" in msg


def test_ring_slots_are_128_byte_multiples_and_the_nvl_hint_covers_them():
    from moe_dispatcher.config import MAX_TOPK, NVL_CONTROL_BYTES, Config, get_combine_config, get_dispatch_config
    from moe_dispatcher.compiled.intranode import combine_slot_bytes, dispatch_slot_bytes, required_nvl_bytes
    from moe_dispatcher.compiled.internode import dispatch_slot_bytes as internode_dispatch_slot_bytes
    # 7168 bf16 + 8 top-k ids and weights + source index = 14404 bytes -> 14464; FP8 with 56 scales -> 7552.
    assert dispatch_slot_bytes(14336, 0, 8) == 14464
    assert dispatch_slot_bytes(7168, 56, 8) == 7552
    assert combine_slot_bytes(14336, 8) == 14464 and combine_slot_bytes(128, 0) == 128
    assert internode_dispatch_slot_bytes(14336, 0, 8) == 14464
    for r in (2, 3, 4, 8):
        for sms in (2, 8, 20, 24, 64):
            for cfg in (get_dispatch_config(r, sms), get_combine_config(r, sms), Config(sms, 1, 1), Config(sms, 32, 512)):
                for h in (128, 896, 2048, 7168):
                    hint = cfg.get_nvl_buffer_size_hint(h * 2, r)  # BF16 rows, or FP8 ones with room for BF16
                    slot = max(dispatch_slot_bytes(h * 2, 0, MAX_TOPK),
                               dispatch_slot_bytes(h, h // 128, MAX_TOPK),
                               combine_slot_bytes(h * 2, MAX_TOPK))
                    assert slot % 128 == 0 and slot <= Config.slot_bytes(h * 2)
                    assert hint >= required_nvl_bytes(r, cfg.num_channels, cfg.num_max_nvl_chunked_recv_tokens, slot,
                                                      NVL_CONTROL_BYTES)
