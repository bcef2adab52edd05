"""Device-to-host copies for the telemetry worker that do not hold up the engine's launches.

:func:`to_host` copies tensors to the host as numpy arrays. From a GPU it copies into pinned
memory without blocking, on the current stream, and then waits on an event with the GIL let
go. A copy into pageable memory (``tensor.cpu()``, ``.item()``, ``.tolist()``, a boolean
mask's size) can instead hold up other threads' kernel launches until the stream reaches the
copy: the worker's stream waits on the engine's, so the engine's next launch would wait for
every step in flight (the recorded runs' late steps: bench/results/replay_causes-*).
Guarantee: the arrays are the tensors' values once the current stream's work before the call
is done, and they own their memory. Cost: one event and a host copy of the bytes; on the CPU,
a plain copy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["to_host", "to_device"]


def to_host(*tensors) -> list[np.ndarray]:
    """The tensors' values on the host, one numpy array each (see the module docstring)."""
    import torch
    if not tensors:
        return []
    if tensors[0].device.type != "cuda":
        return [t.detach().to("cpu", copy=True).numpy() for t in tensors]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, t in zip(pinned, tensors):
        host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()   # lets the GIL go while it waits
    return [np.array(host.numpy(), copy=True) for host in pinned]


def to_device(values, dtype, device):
    """A tensor of ``values`` (a list or array) on ``device``: from pinned memory without
    blocking where it is a GPU (a pageable copy would hold the same lock as in ``to_host``)."""
    import torch
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
