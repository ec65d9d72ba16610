"""Rerun guard: sync-free expert-row sizing that never loses a token.

A dispatch sized with a fixed row count M (sizing.py) needs no host sync, but a routing that needs more than
M rows on some rank loses the rows past M. Inside ``run_step(step, zero_grad)`` (the default ``auto`` sizing
mode uses fixed M only there, on GPUs):

1. every normal-mode dispatch of the step uses the dispatcher's fixed M and folds, on the device, the rows it
   needed and its excess over M into running maxima (no host sync, no collective). The rows needed are the
   handle's rows_needed: the padded per-expert counts the dispatch exchanged, which count the rows an
   overflow dropped too (a count over the rows kept would read M exactly where each row holds one pair);
2. at the step's end, one all-reduce per dispatch group (the most rows each dispatcher needed, which raises
   its high-water mark identically on every rank of the group) and one over the world (did any dispatch
   anywhere overflow), then one host read of all of it: the only host sync of the step that is ours, where
   a training step synchronises anyway (loss, gradient norm, optimizer);
3. if any dispatch overflowed, the Buffers forget the drops they would report at their next synchronised
   dispatch (the re-run's first), ``zero_grad()`` is called and the step runs again with exact
   (synchronised) sizing everywhere, so its result is what an exact step gives. Later steps use fixed M
   again, sized from the raised high-water marks with a wider headroom (sizing.ExpertRowBudget.widen). Every backend takes part alike: the reference drops the
   rows past M and reports them as the kernels do.

With ``bound`` sizing run_step runs the step once and then reads every call's need not read yet
(check_expert_rows): an overflow raises by the end of the step that had it.

This is the protocol Megatron-Core's PagedStashRunner follows for HybridEP's static budget (detect on the
device, check once per step, re-run the step in synced dropless mode). Side effects of a re-run step are
those of running the step twice: whatever ``step`` consumes (data) it must consume again alike, and state
it updates outside autograd (e.g. the router's per-expert token counts for aux-loss-free balancing, which
Megatron accumulates during the forward) counts the first attempt too.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .buffers import _buffers
from .sizing import fixed_rows_allowed, guard_phase, rows_setting  # noqa: F401  (fixed_rows_allowed: API)

_dispatchers: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # serial -> dispatcher
_serials = itertools.count()
stats = {"steps": 0, "reruns": 0}


def track(dispatcher) -> None:
    """Register a normal-mode dispatcher whose row budget run_step checks (in construction order, which is
    the same on every rank of its group)."""
    _dispatchers[next(_serials)] = dispatcher


def _check_step() -> bool:
    """Read the step's row needs of every guarded dispatcher (see the module docstring). Returns whether any
    dispatch on any rank overflowed its M. Collective: one all-reduce per dispatch group that was guarded,
    one over the world (ranks without a guarded dispatch take part with "no overflow")."""
    per_group: dict[Any, list] = {}
    for serial in sorted(_dispatchers.keys()):
        d = _dispatchers.get(serial)
        pair = d._row_budget.take_step() if d is not None else None
        if pair is not None:
            per_group.setdefault(d.group, []).append((d, pair))
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("cuda", torch.cuda.current_device()) if (
        world > 1 and dist.get_backend() == "nccl") else torch.device("cpu")
    overflow = torch.full((1,), -1, dtype=torch.int64, device=device)
    reduced = []
    for group, entries in per_group.items():
        needs = torch.stack([pair for _, pair in entries])  # [n, 2]: rows needed, excess over M
        if world > 1 and dist.get_world_size(group) > 1:
            dist.all_reduce(needs, op=dist.ReduceOp.MAX, group=group)
        reduced.append((entries, needs[:, 0]))
        overflow = torch.maximum(overflow, needs[:, 1].max().reshape(1).to(device))
    if world > 1:
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
    host = torch.cat([overflow] + [needs.to(device) for _, needs in reduced]).tolist()  # the one host read
    pos = 1
    overflowed = host[0] > 0
    for entries, _ in reduced:
        for d, _ in entries:
            d._row_budget.observe(int(host[pos]))
            if overflowed:  # the same on every rank (the overflow flag is reduced over the world)
                d._row_budget.widen()
            pos += 1
    return overflowed


def _discard_buffer_row_checks() -> None:
    """The Buffer also remembers fixed-size calls' excess (and the compiled kernels an exchange that dropped
    rows), to raise at its next synchronised dispatch. Inside run_step the checks above are the authority: an
    overflow the guard undoes must not raise there (in particular not in the step's exact re-run), nor the
    drops a capacity factor makes by choice, and a bound overflow has raised already. Called on every rank
    after the step's checks waited for its dispatches (_check_step's host read, check_expert_rows)."""
    for _, buffer in list(_buffers.values()):
        buffer._forget_dropped_rows()


def check_expert_rows() -> None:
    """Check every fixed-row dispatch not checked yet (``bound`` sizing reads each call's need 2 calls later;
    a capacity factor counts its drops): waits for the latest calls' needs, no collective. Raises
    RuntimeError on every rank alike if some rank needed more rows than its M. run_step calls it at each
    step's end; a loop that does not use run_step (inference with ``bound``) calls it where its step ends."""
    for serial in sorted(_dispatchers.keys()):
        d = _dispatchers.get(serial)
        if d is not None:
            d._row_budget.settle()


def run_step(step: Callable[[], Any], zero_grad: Callable[[], None]) -> Any:
    """Run one training step (forward and backward; not the optimizer update) with sync-free expert-row
    sizing, re-running it with exact sizing if any dispatch overflowed (module docstring). ``zero_grad``
    clears the gradients the first attempt accumulated. Returns what the successful attempt returned.
    With ``bound`` sizing the step runs once and its calls are all checked at its end (check_expert_rows)."""
    if guard_phase.depth:  # nested: the outer run_step checks
        return step()
    if rows_setting() != "auto":  # fixed sizing chosen: nothing to re-run, but nothing left unchecked
        result = step()
        check_expert_rows()
        if rows_setting() == "bound":  # exact sizing drops nothing: other users' overflow records stay
            _discard_buffer_row_checks()
        return result
    guard_phase.depth += 1
    try:
        result = step()
        stats["steps"] += 1
        overflowed = _check_step()
        check_expert_rows()  # calls under a capacity factor (they drop by choice: counted, never re-run)
        _discard_buffer_row_checks()
        if not overflowed:
            return result
        stats["reruns"] += 1
        zero_grad()
        guard_phase.exact_rerun = True
        try:
            result = step()
        finally:
            guard_phase.exact_rerun = False
        return result
    finally:
        guard_phase.depth -= 1
