"""EventOverlap: a CUDA event (or nothing, on CPU) plus the tensors that must stay alive until it fires; EventHandle:
an event recorded where it is made (DeepEP V1's, for `EventOverlap(EventHandle())` as a previous_event)."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch


class EventHandle(torch.cuda.Event):
    """A CUDA event recorded on the current stream when it is made: it marks the work queued there so far.

    DeepEP V1-compatible (code passes `previous_event=EventOverlap(EventHandle())`, the same as Buffer.capture()).
    Being a torch.cuda.Event, it goes wherever one does (EventOverlap.event, Stream.wait_event).
    """

    def __init__(self) -> None:
        super().__init__()
        self.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current stream wait for this event (no host blocking)."""
        torch.cuda.current_stream().wait_event(self)


class EventOverlap:
    """Handle to asynchronous work, DeepEP V1-compatible.

    event: the event recorded after the work: a `torch.cuda.Event`, or the native event of a cached call's fast path
        (CommEvent of csrc/bindings/stream_join.h: the same wait / query / synchronize); None when the work
        already finished (CPU) or the call was synchronous.
    extra_tensors: kept referenced until this object dies, so their memory is not reused too early.
    """

    def __init__(self, event: Optional[torch.cuda.Event] = None,
                 extra_tensors: Optional[Iterable[Any]] = None) -> None:
        self.event = event
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else None

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (no host blocking). No-op without an event."""
        if self.event is not None:
            self.event.wait()  # stream None: the current stream

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={'set' if self.event is not None else None})"
