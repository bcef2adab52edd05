"""instrumentation/host_copy.py: the worker's copies to the host give the values, own their
memory, and on a GPU leave another thread's kernel launches free while they wait."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from sightline.instrumentation.host_copy import to_device, to_host


def test_copies_to_the_host_hold_the_values_and_own_their_memory():
    a = torch.arange(12, dtype=torch.int64).view(3, 4)
    b = torch.tensor([1.5, -2.0], dtype=torch.float64)
    ha, hb = to_host(a, b)
    assert ha.tolist() == a.tolist() and hb.tolist() == [1.5, -2.0]
    a.zero_()   # the caller resets its state after taking it
    assert ha[2, 3] == 11 and ha.dtype == np.int64
    assert to_host() == []
    assert to_device([[1, 2], [3, 4]], torch.int64, torch.device("cpu")).tolist() == [[1, 2], [3, 4]]


def _launch_wait_while(copy) -> float:
    """The longest kernel launch of the calling thread's, in seconds, while another thread's
    ``copy`` waits on a stream that waits for about 200 ms of GPU work."""
    device = torch.device("cuda")
    busy, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
    x = torch.ones(1024, device=device)
    small = torch.zeros(16, device=device)
    to_host(x)   # pinned memory from the caching allocator from now on
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(int(2e8))   # about 100-200 ms of spinning on the GPU
    started = threading.Event()

    def worker():
        with torch.cuda.stream(side):
            side.wait_stream(busy)
            started.set()
            copy(x * 2)

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    time.sleep(0.01)
    longest = 0.0
    while thread.is_alive():
        t0 = time.perf_counter()
        small.add_(1)   # a launch on the default stream, independent of both
        longest = max(longest, time.perf_counter() - t0)
        time.sleep(0.001)
    thread.join()
    torch.cuda.synchronize()
    return longest


@pytest.mark.gpu
def test_a_copy_waiting_on_the_gpu_leaves_other_threads_launches_free():
    """While the worker's copy waits ~100 ms for its stream, the engine thread's launches
    return in well under a millisecond each; a pageable ``.cpu()`` is measured beside it."""
    ours = _launch_wait_while(lambda t: to_host(t))
    pageable = _launch_wait_while(lambda t: t.cpu().numpy())
    print(f"longest launch while the copy waited: to_host {ours * 1e3:.3f} ms, .cpu() {pageable * 1e3:.3f} ms")
    assert ours < 0.005, (ours, pageable)
    (host,) = to_host(torch.full((4,), 3.0, device="cuda"))
    assert host.tolist() == [3.0] * 4
