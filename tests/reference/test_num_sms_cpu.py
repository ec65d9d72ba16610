"""The default SM count (config.default_num_sms) and how the Buffer applies it, on CPU.

The rule reads measured sweeps (config.NUM_SMS_SWEEPS) and answers the smallest SM count within 1/NUM_SMS_CEILING
of the sweep's best time; the Buffer takes it for fresh dispatches without a Config while Buffer.num_sms is the
untouched default (DeepEP V1's class attribute, reading as 20), and honours a Config or Buffer.set_num_sms."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_dispatcher import Buffer, Config
from moe_dispatcher import config as cfg

T, H, E, K = 16, 256, 8, 2
# A made-up sweep for 1 rank: best 49 us at 16 SMs; 12 SMs (50 us) is within 1/0.95 of it, 8 SMs (52) too -> 8.
SWEEP_SMALL = {4: 100.0, 8: 51.0, 12: 50.0, 16: 49.0}
SWEEP_LARGE = {8: 300.0, 16: 160.0, 24: 100.0, 32: 99.0}  # best 99; 24 within -> 24


@pytest.fixture
def sweeps(monkeypatch):
    table = {(1, True): {T * H * 2: SWEEP_SMALL, 4096 * H * 2: SWEEP_LARGE},
             (2, False): {T * H * 2: {6: 10.0, 10: 9.0}}}
    monkeypatch.setattr(cfg, "NUM_SMS_SWEEPS", table)
    monkeypatch.setattr(cfg, "NUM_SMS_SWEEPS_DIRECT", {(1, True): {T * H * 2: {2: 90.0, 4: 40.0, 6: 39.0}}})
    return table


def test_rule_picks_the_smallest_count_at_the_ceiling(sweeps):
    assert cfg.default_num_sms(1, True, H * 2, T) == 8
    assert cfg.default_num_sms(1, True, H * 2, 4096) == 24
    # the nearest measured payload on a log scale (16 and 4096 tokens measured): 128 is nearer 16, 512 nearer 4096
    assert cfg.default_num_sms(1, True, H * 2, 128) == 8
    assert cfg.default_num_sms(1, True, H * 2, 512) == 24
    assert cfg.default_num_sms(1, True, H, 2 * T) == 8  # hidden bytes x tokens is the payload
    assert cfg.default_num_sms(2, False, H * 2, T) == 10  # 6 SMs: 10 us > 9 / 0.95
    # no sweep for (ranks, NVLink): DeepEP V1's 20
    assert cfg.default_num_sms(1, False, H * 2, T) == cfg.NUM_SMS_FALLBACK == 20
    assert cfg.default_num_sms(8) == 20
    # tokens unknown: REFERENCE_TOKENS per rank
    assert cfg.default_num_sms(1, True, H * 2) == cfg.default_num_sms(1, True, H * 2, cfg.REFERENCE_TOKENS)
    # with a peer pool (direct dispatch, one NVLink domain) the direct table: 4 SMs (40 us <= 39 / 0.95)
    assert cfg.default_num_sms(1, True, H * 2, T, direct=True) == 4
    assert cfg.default_num_sms(2, False, H * 2, T, direct=True) == 10  # no direct path across domains
    assert cfg.default_num_sms(2, True, H * 2, T, direct=True) == cfg.NUM_SMS_FALLBACK  # no sweep
    # the bound covers every answer (Buffers are sized from it)
    assert cfg.default_num_sms_bound(1) == 24 and cfg.default_num_sms_bound(2) == 20
    with pytest.raises(TypeError, match="num_tokens"):
        cfg.default_num_sms(1, True, H * 2, 4.0)


def test_committed_table_is_usable():
    """Every sweep of the committed table is a valid choice set: even positive SM counts, positive times; the bound
    covers every answer for sizes from 1 token to 64K tokens of 4 KB to 32 KB rows."""
    for direct, (ranks, nvlink), sweeps in [(d, key, sweeps) for d, table in ((False, cfg.NUM_SMS_SWEEPS),
                                                                         (True, cfg.NUM_SMS_SWEEPS_DIRECT))
                                            for key, sweeps in table.items()]:
        assert isinstance(ranks, int) and ranks >= 1 and isinstance(nvlink, bool)
        for payload, times in sweeps.items():
            assert payload > 0 and len(times) >= 2, (ranks, nvlink, payload)
            assert all(s >= 2 and s % 2 == 0 and t > 0 for s, t in times.items()), times
        for hidden_bytes in (4096, 14336, 32768):
            for tokens in (1, 4096, 65536):
                assert (cfg.default_num_sms(ranks, nvlink, hidden_bytes, tokens, direct=direct)
                        <= cfg.default_num_sms_bound(ranks))


def test_buffer_num_sms_default_and_set():
    before = Buffer.num_sms
    assert cfg.is_default_num_sms(before) and before == 20 and isinstance(before, int)  # DeepEP V1 reads 20
    assert Buffer.get_dispatch_config(4).num_sms == cfg.default_num_sms_bound(4)
    try:
        Buffer.set_num_sms(24)
        assert Buffer.num_sms == 24 and not cfg.is_default_num_sms(Buffer.num_sms)
        assert Buffer.get_dispatch_config(4).num_sms == 24 and Buffer.get_combine_config(2).num_sms == 24
        Buffer.set_num_sms(20)  # setting DeepEP's value explicitly pins it too
        assert not cfg.is_default_num_sms(Buffer.num_sms)
    finally:
        Buffer.set_num_sms(before)  # setting back the value read restores the default
    assert cfg.is_default_num_sms(Buffer.num_sms)


@pytest.fixture
def world(tmp_path, sweeps, monkeypatch):
    """A 1-rank gloo Buffer whose reference backend records the Config each fresh dispatch hands it."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        buf = Buffer(backend="reference", explicitly_destroy=True)
        seen = []
        ref = buf._reference_normal
        real = ref.dispatch

        def recording(*args, **kwargs):
            seen.append(kwargs["config"] if "config" in kwargs else args[-1])
            return real(*args, **kwargs)

        monkeypatch.setattr(ref, "dispatch", recording)
        yield buf, seen
        buf.destroy()
    finally:
        dist.destroy_process_group()


def _routing():
    g = torch.Generator().manual_seed(0)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    return idx, torch.rand(T, K, generator=g), torch.randn(T, H, generator=g).bfloat16()


def test_fresh_dispatch_takes_the_rule_unless_told(world):
    buf, seen = world
    idx, weights, x = _routing()
    n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout = dict(num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
                  topk_idx=idx, topk_weights=weights)
    # The default: the rule for 1 rank, one NVLink domain, BF16 rows of H, at the reference token count (not
    # this call's T: the Buffer knows no count every rank shares), with the tuned chunks.
    handle = buf.dispatch(x, **layout)[4]
    assert seen[-1] == cfg.get_dispatch_config(1, 24) and cfg.default_num_sms(1, True, H * 2) == 24
    buf.expert_major_dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=E)
    assert seen[-1].num_sms == 24
    # FP8 rows are H bytes: half the payload (still nearest the 4096-token sweep)
    buf.dispatch((x.float().to(torch.float8_e4m3fn), torch.ones(T, H // 128)), **layout)
    assert seen[-1].num_sms == cfg.default_num_sms(1, True, H) == 24
    # A Config given is honoured.
    mine = Config(6, 4, 128)
    buf.dispatch(x, config=mine, **layout)
    assert seen[-1] is mine
    # A count set with set_num_sms: the backend's default (None) at Buffer.num_sms.
    before = Buffer.num_sms
    try:
        Buffer.set_num_sms(16)
        buf.dispatch(x, **layout)
        assert seen[-1] is None
    finally:
        Buffer.set_num_sms(before)
    # Cached calls keep the handle's channels: no Config is made for them.
    n = len(seen)
    buf.dispatch(x, handle=handle)
    buf.combine(buf.dispatch(x, handle=handle)[0], handle)
    assert len(seen) == n
