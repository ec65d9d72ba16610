"""The step-end check of fixed-size expert rows: an overflow, or a refused call, raises by the end of its step.

A dispatch with a fixed row count M (sizing.py: $MOE_DISPATCHER_EXPERT_ROWS=bound, or a config's
moe_expert_rank_capacity_factor) has its rows needed read LAG calls later, so the last calls of a step would
be read only during the next step, after the optimizer applied this one, and the last calls of a run never.
``run_step(step)`` runs one step and then reads every call not read yet (check_expert_rows): with ``bound``
an overflow raises RuntimeError on every rank there; a capacity factor's drops are counted. With the default
exact sizing no call has a fixed M, and run_step only runs the step.

A fixed-row dispatch is a num_worst_tokens call, which never waits for the compiled kernels' notify on the host.
When its ranks disagree (a signature field, bad expert ids, ...) notify refuses it on every rank: it moves no
row and returns padding rows only, and the Buffer reports it at its next synchronised dispatch, which bound
sizing and a capacity factor never make after their first call. So check_expert_rows also asks every Buffer a
fixed-row call used since the last check (note_fixed_rows) to raise such a refusal now
(Buffer.check_refused_calls): SignatureMismatch on every rank alike, naming the fields as the synchronised
dispatch would. No collective unless there is one to report; nothing with exact sizing (no Buffer is noted).
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

from .buffers import _buffers

_dispatchers: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # serial -> dispatcher
_serials = itertools.count()
# Buffers that fixed-row dispatches used since the last check, in first-use order (the same on every rank): id ->
# Buffer. Held until the check, so a Buffer replaced mid-step (buffers.get_buffer) is still checked.
_fixed_row_buffers: dict[int, Any] = {}


def track(dispatcher) -> None:
    """Register a normal-mode dispatcher whose row budget check_expert_rows reads (in construction order, which
    is the same on every rank of its group)."""
    _dispatchers[next(_serials)] = dispatcher


def note_fixed_rows(buffer) -> None:
    """A dispatcher made a fixed-row (num_worst_tokens) dispatch on `buffer`: check_expert_rows asks it for refused
    calls. One dict look-up per call."""
    if id(buffer) not in _fixed_row_buffers:
        _fixed_row_buffers[id(buffer)] = buffer


def _check_refused_calls() -> None:
    """Buffer.check_refused_calls on every Buffer noted since the last check, in the order they were noted (the
    same on every rank: the ranks made the same calls), forgetting each before it is checked. Raises
    SignatureMismatch on every rank alike if the kernels refused one of their calls (a Buffer destroyed on every
    rank meanwhile is skipped)."""
    while _fixed_row_buffers:
        buffer = _fixed_row_buffers.pop(next(iter(_fixed_row_buffers)))
        if not buffer._destroyed:
            buffer.check_refused_calls()


def _discard_buffer_row_checks() -> None:
    """The Buffer also remembers fixed-size calls' excess (and the compiled kernels an exchange that dropped
    rows), to raise at its next synchronised dispatch. After check_expert_rows the row budgets are the
    authority: a capacity factor's drops are made by choice and must not raise there, and a bound overflow
    has raised already. Called on every rank alike, after check_expert_rows waited for the step's fixed-row
    dispatches."""
    for _, buffer in list(_buffers.values()):
        buffer._forget_dropped_rows()


def check_expert_rows() -> bool:
    """Check every fixed-row dispatch not checked yet (``bound`` sizing reads each call's need 2 calls later;
    a capacity factor counts its drops): waits for the latest calls' needs and notifies, no collective unless
    there is a refusal to report. Raises
    SignatureMismatch on every rank alike if the kernels refused one of those calls (its ranks disagreed: it
    moved nothing; see the module docstring), else RuntimeError on every rank alike if some rank needed more
    rows than its M. run_step calls it at each step's end; a loop that does not use run_step (inference with
    ``bound``) calls it where its step ends. Returns whether any dispatch since the last check had a fixed M
    (the same on every rank)."""
    _check_refused_calls()
    fixed = False
    for serial in sorted(_dispatchers.keys()):
        d = _dispatchers.get(serial)
        if d is not None:
            fixed |= d._row_budget.settle()
    return fixed


def run_step(step: Callable[[], Any]) -> Any:
    """Run one training step (forward and backward; not the optimizer update), then check its fixed-row
    dispatches (check_expert_rows; nothing to check with the default exact sizing). Returns what ``step``
    returned."""
    result = step()
    if check_expert_rows():
        _discard_buffer_row_checks()
    return result
