"""Pure host-side helpers the compiled backends share (CPU: no kernels involved)."""
from __future__ import annotations

import pytest
import torch

from moe_dispatcher.compiled import row_geometry, timeout_message


def test_row_geometry():
    assert row_geometry(torch.zeros(3, 7168, dtype=torch.bfloat16), None, "intranode") == (14336, 0)
    fp8 = torch.zeros(2, 256, dtype=torch.float8_e4m3fn)
    assert row_geometry(fp8, torch.ones(2, 2), "internode") == (256, 2)
    with pytest.raises(ValueError, match="multiple of 16 bytes for the internode kernels"):
        row_geometry(torch.zeros(1, 7, dtype=torch.bfloat16), None, "internode")
    with pytest.raises(ValueError, match="FP8 scales"):
        row_geometry(fp8, torch.ones(2, 2, dtype=torch.float16), "intranode")


def test_timeout_message_names_rank_phase_and_peer():
    msg = timeout_message("intranode", (1, "combine receive", 3, 0), 2.0, "MOE_DISPATCHER_TIMEOUT_S")
    assert msg.startswith("moe_dispatcher intranode: rank 3 timed out after 2 s in combine receive waiting for "
                          "rank 0")
    assert "MOE_DISPATCHER_TIMEOUT_S" in msg


def test_env_mode_picks_the_variant(monkeypatch):
    from moe_dispatcher.compiled.intranode import EM_COMBINE_MODES, EM_DISPATCH_MODES, env_mode
    monkeypatch.delenv("MOE_DISPATCHER_EM_DISPATCH", raising=False)
    assert env_mode("MOE_DISPATCHER_EM_DISPATCH", EM_DISPATCH_MODES) == "split"
    monkeypatch.setenv("MOE_DISPATCHER_EM_DISPATCH", " Fused ")
    assert env_mode("MOE_DISPATCHER_EM_DISPATCH", EM_DISPATCH_MODES) == "fused"
    monkeypatch.setenv("MOE_DISPATCHER_EM_COMBINE", "")
    assert env_mode("MOE_DISPATCHER_EM_COMBINE", EM_COMBINE_MODES) == "split"
    monkeypatch.setenv("MOE_DISPATCHER_EM_COMBINE", "both")
    with pytest.raises(ValueError, match="MOE_DISPATCHER_EM_COMBINE must be one of"):
        env_mode("MOE_DISPATCHER_EM_COMBINE", EM_COMBINE_MODES)


def test_parse_nvl_variant_knobs():
    from moe_dispatcher.compiled.intranode import NVL_VARIANTS, dispatch_slot_bytes, parse_nvl_variant
    for i, name in enumerate(NVL_VARIANTS):
        assert parse_nvl_variant(name) == (name, i, 16)
    # Knobs in any order, canonical sorted; bits as protocol.h's ring mode lays them out.
    name, mode, align = parse_nvl_variant(" Stream/w5/P/b12/a/u/h/e ")
    assert name == "stream/a/b12/e/h/p/u/w5" and align == 128
    assert mode == 1 | 5 << 4 | 1 << 10 | 1 << 11 | 12 << 12 | 1 << 22 | 1 << 23
    assert parse_nvl_variant("chunked/a") == ("chunked/a", 0, 128)
    for bad in ("tma", "stream/", "stream/x", "stream/w64", "stream/p/p", "chunked/p", "chunked/e", "stream/wx", "stream/a2"):
        with pytest.raises(ValueError):
            parse_nvl_variant(bad)
    # Slot alignment: 7168 bf16 + 8 top-k + source = 14404 bytes -> 14416 (16) or 14464 (128).
    assert dispatch_slot_bytes(14336, 0, 8) == 14416
    assert dispatch_slot_bytes(14336, 0, 8, align=128) == 14464
