"""EventHandle (DeepEP V1's): an event recorded on the current stream where it is made."""
import pytest
import torch

from moe_dispatcher import EventHandle, EventOverlap


def test_is_a_cuda_event():
    assert issubclass(EventHandle, torch.cuda.Event)


@pytest.mark.gpu(1)
def test_orders_another_stream_after_the_queued_work():
    n = 1 << 24
    a = torch.ones(n, device="cuda")
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    producer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)  # the multiply below would otherwise likely finish before the wait matters
        a.mul_(3)
        handle = EventHandle()
    with torch.cuda.stream(consumer):
        EventOverlap(handle).current_stream_wait()
        total = a.sum()
    torch.cuda.synchronize()
    assert total.item() == 3.0 * n
