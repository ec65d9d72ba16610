"""How many expert-major rows the normal-mode dispatcher asks for: exact by default, fixed on request.

The expert-major dispatch writes a tensor of M rows whose M the host must know when it allocates it.

- ``exact`` ($MOE_DISPATCHER_EXPERT_ROWS unset or ``exact``, the default): every fresh dispatch waits for
  the exchanged counts (one host sync) and M is exactly the rows this rank needs (pairs plus alignment
  padding); tokens_per_expert is on the CPU. No row is ever dropped, and no row past the need costs
  anything in the experts, the probs multiply or their backward. Measured against a fixed M = high-water
  mark x 1.1 whose overflow re-ran the step exactly (2 x H200, Qwen3-MoE-like training, EP=2, 30 steps,
  same seed): exact 61,473 tokens/s, experts 17.03 ms/step, combine 4.33 ms (GPU kernel time), against
  59,331 tokens/s, 21.71 ms and 9.02 ms with 2 steps re-run; on 4 x H200 with the DeepSeek-V3-like config
  60,538 against 60,068 tokens/s. A fixed M with room for every row that can come (R x T x K: no host sync and
  no row ever dropped) lost too: 61,483 against exact's 68,268 tokens/s on 4 x H200 (qwen3_moe_like_4gpu.yaml,
  M = 131,072, 4x the need), the experts' passes over the padding rows costing more than the sync.
  So exact is the only automatic sizing.
- ``bound`` (opt-in, for stable routings: inference, benchmarks): no host sync. The first call
  of a dispatcher is exact and seeds a high-water mark of the rows needed (its maximum over the group, one
  all-reduce before the first fixed M, so every rank sizes alike) ($MOE_DISPATCHER_EXPERT_ROWS_INITIAL=N:
  it uses M = N instead, no host sync at all); later calls use M = max(mark x headroom, mark + 2 x alignment
  x local experts) ($MOE_DISPATCHER_EXPERT_ROWS_HEADROOM, default 1.1), rounded up to 128, and
  tokens_per_expert stays on the device. Each call's need is reduced to its maximum over the group (an
  all-reduce on a side stream, which the compute stream does not wait for), copied to pinned host memory
  and read LAG (2) calls later: by then it is complete in practice, so reading it does not wait. Every rank
  reads the same group-wide value at the same call, so all ranks raise the mark alike and, when some rank
  needed more rows than its M (its rows past M were dropped), all ranks raise RuntimeError at the same
  call, before that call's dispatch: no rank is left waiting in a collective for a rank that raised. The
  calls a step made last are read at the step's end (guard.check_expert_rows, which guard.run_step and the
  training driver call), so an overflow raises by the end of its step at the latest (and so does a call the
  compiled kernels refused because its ranks disagreed: guard.py). The need is the one
  the dispatch's exchanged counts give (rows_needed of the expert-major handle), which counts the rows a
  dispatch dropped too.
- The variables are read at a dispatcher's first call and must be alike on every rank of its group: their raw
  values are gathered there once, and one that differs raises ValueError on every rank, naming each rank's
  value; they are parsed after that, so a value that cannot be parsed raises on every rank too.
- ``moe_expert_rank_capacity_factor`` set in the config (Megatron's static budget for HybridEP), in either
  mode: M = T * K * factor, rounded up; pairs past it are dropped (a training choice, like a capacity
  factor) and counted (ExpertRowBudget.dropped_calls), never raised.
"""
from __future__ import annotations

import math
from collections import deque

import torch

from moe_dispatcher.env import differing_setting, env_choice, env_float, env_int, env_raw

ROWS_ENV = "MOE_DISPATCHER_EXPERT_ROWS"
HEADROOM_ENV = "MOE_DISPATCHER_EXPERT_ROWS_HEADROOM"
INITIAL_ENV = "MOE_DISPATCHER_EXPERT_ROWS_INITIAL"
ROWS_MODES = ("exact", "bound")
DEFAULT_HEADROOM = 1.1
LAG = 2  # calls between a dispatch and the reading of its need (see the module docstring)
ROW_QUANTUM = 128  # M is a multiple of this (and of the alignment), so M changes rarely
_PINNED_SLOTS = 64


def rows_setting() -> str:
    """$MOE_DISPATCHER_EXPERT_ROWS: 'exact' (default) or 'bound'; anything else raises ValueError naming the
    variable and the accepted values."""
    return env_choice(ROWS_ENV, ROWS_MODES, "exact")


class ExpertRowBudget:
    """num_worst_tokens for each expert-major dispatch of one dispatcher (see the module docstring)."""

    def __init__(self, align: int, capacity_factor: float | None = None, headroom: float | None = None,
                 num_local_experts: int = 1, group=None) -> None:
        self.align = max(1, align)
        self.quantum = math.lcm(ROW_QUANTUM, self.align)
        self.capacity_factor = capacity_factor
        if headroom is not None and not (math.isfinite(headroom) and headroom >= 1.0):
            raise ValueError(f"ExpertRowBudget: headroom must be a finite number >= 1, got {headroom!r}")
        # None: $MOE_DISPATCHER_EXPERT_ROWS_HEADROOM, read at the first call after the ranks agreed on its raw
        # value (_agree_settings): a value only one rank cannot parse then raises on every rank, as differing
        self.headroom = None if headroom is None else float(headroom)
        self.slack = 2 * self.align * max(1, num_local_experts)  # rows: the alignment padding may move that much
        self.group = group  # process group whose maximum need every rank uses (None: this rank's own)
        self.high_water = None  # most rows any call needed so far (host int), None before the first call
        # high_water holds this rank's own counts (from exact calls), not yet the group's maximum: the first
        # fixed M is then made from the group's maximum mark (one all-reduce), so every rank gets the same M
        self._mark_is_local = False
        self._settings: tuple[str, int] | None = None  # (mode, initial rows): _agree_settings, at the first call
        self.dropped_calls = 0  # calls under a capacity factor that dropped rows (observed so far)
        self._pending: deque = deque()  # (pinned int64 slot, event or None, limit, call number)
        self._pinned = None
        self._next_slot = 0
        self._calls = 0
        self._side = None  # side stream of the all-reduce and the copy
        self._settled_calls = 0  # self._calls at the last settle()

    def _round(self, rows: float) -> int:
        return max(self.quantum, math.ceil(rows / self.quantum) * self.quantum)

    def rows_for(self, num_tokens: int, num_topk: int, device: torch.device | None = None) -> int:
        """M for the next call, or 0: make it a synchronised (exact) call, as the default sizing always does
        (without a capacity factor). Raises RuntimeError (on every rank at the same call) when an earlier
        call overflowed. device: where the group's collectives run (a CUDA device for NCCL; None: CPU).

        Every rank returns the same M at the same call: an overflow is judged against it on every rank, so
        an M that differed by rank could let one rank raise while another went on to its next collective
        and waited there. With bound sizing the mark seeded by exact calls (each rank's own count) is
        therefore replaced by its maximum over the group before the first fixed M (one all-reduce, once);
        the needs of later calls are group-wide already (watch)."""
        self.poll()
        if self.capacity_factor is not None:
            return self._round(num_tokens * num_topk * self.capacity_factor)
        if self._settings is None:
            self._settings = self._agree_settings()
        mode, initial = self._settings
        if mode != "bound":
            return 0
        if self.high_water is None:
            return self._round(initial) if initial > 0 else 0
        if self._mark_is_local:
            self.high_water = self._group_max(self.high_water, device)
            self._mark_is_local = False
        return self._round(max(self.high_water * self.headroom, self.high_water + self.slack))

    def _agree_settings(self) -> tuple[str, int]:
        """(mode, initial rows) from $MOE_DISPATCHER_EXPERT_ROWS and $MOE_DISPATCHER_EXPERT_ROWS_INITIAL, read once
        (the first call) and the same on every rank: the raw values of the sizing variables (the headroom's too,
        parsed here unless __init__ was given one) are gathered over the group, and one that differs raises
        ValueError on every rank, naming each rank's value (a rank sizing exactly beside one sizing by a bound
        would wait alone in the bound's collectives)."""
        names = (ROWS_ENV, HEADROOM_ENV, INITIAL_ENV)
        if self.group is not None and torch.distributed.get_world_size(self.group) > 1:
            gathered: list = [None] * torch.distributed.get_world_size(self.group)
            torch.distributed.all_gather_object(gathered, tuple(env_raw(name) for name in names), group=self.group)
            for i, name in enumerate(names):
                differing = differing_setting(name, [r[i] for r in gathered], "the expert-parallel group")
                if differing is not None:
                    raise differing
        if self.headroom is None:
            self.headroom = env_float(HEADROOM_ENV, DEFAULT_HEADROOM, minimum=1.0)
        return rows_setting(), env_int(INITIAL_ENV, 0, minimum=0)

    def observe(self, rows_needed: int) -> None:
        """A synchronised call's exact row count (already on the host): this rank's own."""
        self._raise_mark(rows_needed)
        self._mark_is_local = True

    def _raise_mark(self, rows_needed: int) -> None:
        self.high_water = rows_needed if self.high_water is None else max(self.high_water, rows_needed)

    def _group_max(self, value: int, device: torch.device | None) -> int:
        """The maximum of `value` over the group (a host sync; the group's backend decides the device)."""
        if self.group is None or torch.distributed.get_world_size(self.group) <= 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def watch(self, rows_needed: torch.Tensor, limit: int) -> None:
        """After a call with num_worst_tokens=limit: read its need later (LAG calls later, or at the step's end:
        settle()), without waiting for it now."""
        self._calls += 1
        if rows_needed.device.type != "cuda":  # CPU: the same protocol, with the reduction done at once
            need = rows_needed.reshape(1).to(torch.int64, copy=True)  # reduced in place: not the handle's
            if self.group is not None and torch.distributed.get_world_size(self.group) > 1:
                torch.distributed.all_reduce(need, op=torch.distributed.ReduceOp.MAX, group=self.group)
            self._pending.append((need, None, limit, self._calls))
            return
        if self._pinned is None:
            self._pinned = torch.zeros(_PINNED_SLOTS, dtype=torch.int64, pin_memory=True)
            self._side = torch.cuda.Stream(device=rows_needed.device)
        if len(self._pending) == _PINNED_SLOTS:  # every slot in flight (LAG < _PINNED_SLOTS: never in practice)
            self._pending[0][1].synchronize()
            self._settle_due(self._pending[0][3])
        slot = self._pinned[self._next_slot:self._next_slot + 1]
        self._next_slot = (self._next_slot + 1) % _PINNED_SLOTS
        compute = torch.cuda.current_stream(rows_needed.device)
        self._side.wait_stream(compute)
        with torch.cuda.stream(self._side):
            need = rows_needed.reshape(1).to(torch.int64, copy=True)  # reduced in place: not the handle's
            if self.group is not None and torch.distributed.get_world_size(self.group) > 1:
                torch.distributed.all_reduce(need, op=torch.distributed.ReduceOp.MAX, group=self.group)
            slot.copy_(need, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        rows_needed.record_stream(self._side)
        self._pending.append((slot, event, limit, self._calls))

    def poll(self) -> None:
        """Take in the needs of the calls LAG or more calls back (the same calls on every rank). Their events
        have completed in practice; if not, this waits for them (a call LAG calls old), never for the
        device as a whole."""
        self._settle_due(self._calls - LAG)

    def settle(self) -> bool:
        """Take in the needs of every call so far, waiting for the latest ones (at a step's end, where the
        host waits for the step anyway): the last LAG calls of a step are checked before the next step, and
        the last calls of a run at all. No collective (each need was reduced over the group at its call),
        and the same calls on every rank, so an overflow raises on every rank alike. Returns whether any
        fixed-row call was made since the last settle()."""
        self._settle_due(self._calls)
        made, self._settled_calls = self._calls > self._settled_calls, self._calls
        return made

    def _settle_due(self, upto: int) -> None:
        while self._pending and self._pending[0][3] <= upto:
            slot, event, limit, _ = self._pending.popleft()
            if event is not None:
                event.synchronize()
            self._settle(int(slot[0]), limit)

    def _settle(self, need: int, limit: int) -> None:
        self._raise_mark(need)  # the group's maximum (reduced at the call): the mark stays the same everywhere
        if need <= limit:
            return
        if self.capacity_factor is not None:
            self.dropped_calls += 1
            return
        raise RuntimeError(f"moe_dispatcher: an expert-major dispatch needed {need} rows (the most of any rank) "
                           f"but was sized for {limit} (the rows past it were dropped); raise {HEADROOM_ENV} (now "
                           f"{self.headroom}) or set {ROWS_ENV}=exact")


def tokens_per_expert_covering(tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [L] counts that add up to exactly `rows` (what torch.split in Megatron's experts needs): the
    rows past the last expert (zero rows, prob 0) are counted in the last expert; device ops only.

    The result carries the counts without that tail as its attribute ``without_tail`` (int64 [L], clamped
    to `rows`): experts that can leave the tail out (GroupedGemmExperts: its grouped GEMMs then compute only
    the rows of some expert; combine never reads the tail) read it, Megatron's experts never see it."""
    ends = tokens_per_expert.to(torch.int64).cumsum(0).clamp_max(rows)
    without_tail = torch.diff(ends, prepend=ends.new_zeros(1))
    ends[-1:] = rows
    covering = torch.diff(ends, prepend=ends.new_zeros(1))
    covering.without_tail = without_tail
    return covering
