"""One rank's view of the tensor-parallel group: all-reduces, step plans, sampled ids.

``TpGroup.join`` makes this process rank ``rank`` of ``size`` through torch.distributed:
NCCL on CUDA for the activations' all-reduces and the sampled ids, with a gloo group on the
host for the step plans; gloo for both on the CPU. Rank 0 lives in the engine core: it plans
each step, sends it (``send_step``: a fixed header, then the batch's lists as one int64
tensor, ``StepMessage``), samples from its own logits and, when the next step may take its
inputs from them on the device (overlapped scheduling), broadcasts the ids. The other ranks
(:mod:`.tp_workers`) receive and run their shard. Timing: with ``begin_timing`` each
all-reduce is bracketed by ``perf_counter_ns``; on the CPU gloo returns when the sum is
done, so the bracket is the rank's wait for the others plus the transfer (on CUDA, where a
call only enqueues, the kernel records of traced steps tell it: :mod:`..instrumentation.kernel_spans`). Cost per step: two small gloo broadcasts, two all-reduces
of ``[T, hidden]`` per layer, and with overlapped scheduling one of ``[S]`` ids. NVLink
multicast stays off (``NCCL_NVLS_ENABLE=0`` before NCCL starts).
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..instrumentation import RankStep
from .model_runner import HostStep

__all__ = ["StepMessage", "TpGroup", "tp_device"]

HEADER_WORDS = 32
_OP_STEP, _OP_STOP = 1, 2
NUM_PARTS = 11   # the lists of a HostStep (model_runner), in order
# Plans wait on an idle server for as long as it is idle: no timeout (a dead peer closes its
# sockets, which ends the wait). The rendezvous and the activations' collectives have one.
_FOREVER = datetime.timedelta(days=3650)
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=600)
_FLAG_TRACED, _FLAG_PROBED, _FLAG_SEND_IDS, _FLAG_TIMED = 1, 2, 4, 8


def tp_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:<rank>`` (one GPU per rank on one host) or the CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch sees no CUDA GPU; use --device cpu")
    if rank >= torch.cuda.device_count():
        raise RuntimeError(f"tensor-parallel rank {rank} needs GPU {rank}, but torch sees "
                           f"{torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", rank)


def _signed(value: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _unsigned(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


@dataclass
class StepMessage:
    """A step as the other ranks receive it: its host batch (``HostStep``: the lists in one
    tensor, the sizes that shape them; the KV block copies to make first after them), the
    graph bucket to replay, and what rank 0 decided about telemetry (trace and probe the
    step, time it; the step span's ids, for the records that point at it)."""

    step_id: int
    host: HostStep
    bucket: int | None
    num_copies: int
    traced: bool = False
    probed: bool = False
    send_ids: bool = False
    timed: bool = False
    trace_id: int = 0
    span_id: int = 0

    def header(self) -> torch.Tensor:
        h = self.host
        flags = (_FLAG_TRACED * self.traced | _FLAG_PROBED * self.probed
                 | _FLAG_SEND_IDS * self.send_ids | _FLAG_TIMED * self.timed)
        words = [_OP_STEP, self.step_id, *h.lengths, h.num_prefill_tokens, h.max_seqlen_q,
                 h.max_seqlen_k, h.num_prefill_seqs, h.num_decode_seqs, h.max_blocks, int(h.gather),
                 -1 if self.bucket is None else self.bucket, self.num_copies, flags,
                 _signed(self.trace_id >> 64), _signed(self.trace_id & (2**64 - 1)),
                 _signed(self.span_id)]
        return torch.tensor(words + [0] * (HEADER_WORDS - len(words)), dtype=torch.long)

    @classmethod
    def from_header(cls, words: list[int]) -> StepMessage:
        """The message without its lists (``host.flat`` None until they come)."""
        lengths = tuple(words[2:2 + NUM_PARTS])
        (n_pre, max_q, max_k, pre_seqs, dec_seqs, max_blocks, gather, bucket, copies, flags,
         trace_hi, trace_lo, span) = words[2 + NUM_PARTS:2 + NUM_PARTS + 13]
        host = HostStep(None, lengths, n_pre, max_q, max_k, pre_seqs, dec_seqs, max_blocks, bool(gather))
        return cls(words[1], host, None if bucket < 0 else bucket, copies,
                   bool(flags & _FLAG_TRACED), bool(flags & _FLAG_PROBED),
                   bool(flags & _FLAG_SEND_IDS), bool(flags & _FLAG_TIMED),
                   (_unsigned(trace_hi) << 64) | _unsigned(trace_lo), _unsigned(span))

    @property
    def num_sampled(self) -> int:
        return self.host.lengths[8]


class TpGroup:
    """This process's membership (see the module docstring). Not thread-safe: one thread
    (the engine loop on rank 0, the worker's loop elsewhere) makes every collective call,
    in the same order on every rank."""

    def __init__(self, rank: int, size: int, device: torch.device, plans) -> None:
        self.rank, self.size, self.device = rank, size, device
        self._plans = plans                  # the host-side group (gloo)
        self._pin = device.type == "cuda"
        self._timed = False
        self._wait_ns = self._calls = self._t0 = self._start_ns = 0

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: torch.device) -> TpGroup:
        """Rendezvous at ``init_method`` (a ``file://`` path every rank names)."""
        os.environ["NCCL_NVLS_ENABLE"] = "0"        # NVLink multicast stays off
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # one host: loopback
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size,
                                    timeout=_COLLECTIVE_TIMEOUT, device_id=device)
        else:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                    timeout=_COLLECTIVE_TIMEOUT)
        plans = dist.new_group(backend="gloo", timeout=_FOREVER)
        return cls(rank, size, device, plans)

    # -- the model's collectives (every rank, in the forward pass) ---------------------------
    def all_reduce(self, x: torch.Tensor) -> None:
        """Sums ``x`` over the ranks in place (the default group: NCCL or gloo)."""
        if self._timed:
            t = time.perf_counter_ns()
            dist.all_reduce(x)
            end = time.perf_counter_ns()
            if self._calls:
                self._wait_ns += end - t
            else:   # the window starts here: before, the ranks' start times differ
                self._t0, self._start_ns = end, time.time_ns()
            self._calls += 1
        else:
            dist.all_reduce(x)

    def begin_timing(self) -> None:
        """The forward pass starts: its all-reduces are timed until ``end_timing``. The
        window runs from the first all-reduce's end (the plan reaches the ranks one after
        the other: their start times say nothing of their speed) to ``end_timing``; the
        later all-reduces are the rank's wait for the others (and the transfer)."""
        self._timed = True
        self._wait_ns = self._calls = 0
        self._start_ns = time.time_ns()
        self._t0 = time.perf_counter_ns()

    def end_timing(self, step_id: int, bytes_per_call: int) -> RankStep:
        window = time.perf_counter_ns() - self._t0
        self._timed = False
        return RankStep(step_id, self.rank, self._start_ns, self._start_ns + window,
                        window - self._wait_ns, self._wait_ns, self._calls, bytes_per_call)

    # -- step plans (rank 0 sends, the others receive) ----------------------------------------
    def send_step(self, message: StepMessage) -> None:
        dist.broadcast(message.header(), 0, group=self._plans)
        if message.host.flat.numel():
            dist.broadcast(message.host.flat, 0, group=self._plans)

    def send_stop(self) -> None:
        words = torch.zeros(HEADER_WORDS, dtype=torch.long)
        words[0] = _OP_STOP
        dist.broadcast(words, 0, group=self._plans)

    def recv_step(self) -> StepMessage | None:
        """The next step from rank 0, or None when it said stop. Waits as long as it takes."""
        header = torch.empty(HEADER_WORDS, dtype=torch.long)
        dist.broadcast(header, 0, group=self._plans)
        words = header.tolist()
        if words[0] == _OP_STOP:
            return None
        message = StepMessage.from_header(words)
        n = sum(message.host.lengths) + 2 * message.num_copies
        message.host.flat = torch.empty(n, dtype=torch.long, pin_memory=self._pin)
        if n:
            dist.broadcast(message.host.flat, 0, group=self._plans)
        return message

    # -- sampled ids (rank 0 samples once) ------------------------------------------------------
    def send_ids(self, ids: torch.Tensor) -> None:
        dist.broadcast(ids, 0)

    def recv_ids(self, n: int) -> torch.Tensor:
        ids = torch.empty(n, dtype=torch.long, device=self.device)
        dist.broadcast(ids, 0)
        return ids

    # -- start-up agreements --------------------------------------------------------------------
    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. the KV blocks each rank can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._plans)
        return int(t.item())

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (e.g. whether graph capture goes on)."""
        t = torch.tensor([int(flag)], dtype=torch.long)
        dist.broadcast(t, 0, group=self._plans)
        return bool(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
