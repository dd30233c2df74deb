"""Activation offload at run time: the saved activations of layers planned "offload" live in host memory between
their forward and their backward.

The ops of passes/activations.py (ops/activation_ops.py) call into it by handle:

    offload(layer, t) -> host        forward, right after t is produced: a host buffer with t's size and stride;
                                     the device->host copy is queued on the "activations" stream
    wait_offloads(layer)             forward, once the next offloaded layer has produced its saved tensors (or
                                     before the forward returns): the compute stream waits for ``layer``'s
                                     copies. The op takes the device tensors as arguments, so the graph keeps
                                     them until here (no compiler may reuse their memory while a copy still
                                     reads it) and lets them go right after: the graph saves only the host copy.
    prefetch(layer, hosts)           backward, one offloaded layer ahead of its use: a fresh device buffer per
                                     saved tensor and its host->device copy, queued on the same stream
    wait(layer, i) -> device         backward, before the first use: the compute stream waits for copy i

One stream carries both directions, so a fetch is always queued after the offload of the same tensor.

Streams (runtime/device.py). CPU build: the stream is one worker thread, the "device" is the CPU, a device
buffer and a host buffer are separate tensors and the copies are real copies: the bytes the ledger books are
bytes really allocated. CUDA: a side stream, pinned host buffers, ``non_blocking`` copies that first wait for
the compute stream, ``record_stream`` on the device tensors the side stream touches; the compute stream waits
for a copy with ``wait_event`` (the host never blocks), so memory the compute stream reuses after a wait is
never still being read by a copy. The CUDA branch has not run on a GPU yet (see docs/activations.md).

Device memory (runtime/memory.py): the category ``"offloaded activations in flight"`` books the device bytes
of offloaded activations while a copy involves them: a saved tensor from its offload to its layer's forward
wait (the graph frees it right after), a fetched buffer from its prefetch to its wait (the graph owns it from
there, like any activation). Activations the graph holds otherwise are the graph's, as everywhere else in the
ledger.
"""
from __future__ import annotations

import collections
import itertools

import torch

from ..plan.host_work import ACTIVATION_COPY, copy_bytes
from . import handles, ranges
from .device import DeviceRuntime
from .events import EventLog
from .memory import ACTIVATIONS, DeviceLedger, HostLedger
from .traffic import ACTIVATION_FETCH, ACTIVATION_OFFLOAD, HostWorkLedger, TrafficLedger

IN_FLIGHT = "offloaded activations in flight"
_REMEMBERED = 100_000


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: a flat buffer of t.numel() elements, viewed with t's strides, holds it."""
    if t.numel() == 0:
        return True
    if any(st < 0 for st in t.stride()):
        return False
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1)
    expected = 1
    for st, s in dims:
        if st != expected:
            return False
        expected *= s
    return True


def offloadable(t: torch.Tensor) -> bool:
    """Tensors the runtime can move and give back with the same size and stride."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and _dense(t)


class ActivationOffloadRuntime:
    def __init__(self, device: DeviceRuntime, ledger: DeviceLedger | None = None, events: EventLog | None = None,
                 traffic: TrafficLedger | None = None, host_ledger: HostLedger | None = None,
                 host_work: HostWorkLedger | None = None):
        self.device = device
        self.traffic = traffic if traffic is not None else TrafficLedger()
        # the CPU build's copies are the host CPU's work (the optimizer's opt.host_work()); a GPU's are DMA
        self.host_work = host_work if host_work is not None else HostWorkLedger()
        self.host_ledger = host_ledger   # books the host copies (the optimizer's, opt.host_memory())
        self.stream = device.stream("activations")
        self.ledger = ledger if ledger is not None else DeviceLedger()
        self.events = events if events is not None else EventLog()
        self._tokens = itertools.count()
        self._offloading: dict[str, list[tuple[int, object]]] = {}          # layer -> (token, copy event)
        self._fetching: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, object]] = {}
        # Storages of the host copies not fetched back yet, by data pointer (tests tell them from device tensors
        # among what autograd saves). The graph does not keep tensors' Python objects alive, so pointers, not
        # weak references, identify them.
        self.host_ptrs: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.stats = {"offloaded_tensors": 0, "offloaded_bytes": 0, "fetched_tensors": 0, "fetched_bytes": 0}
        self.handle = handles.register(self)

    # ------------------------------------------------------------------------------------------ forward
    @ranges.ranged(ranges.ACTIVATION_OFFLOAD)
    def offload(self, layer: str, t: torch.Tensor) -> torch.Tensor:
        self.ledger.set_phase("forward")
        nbytes = t.numel() * t.element_size()
        host = self.device.host_buffer(t.numel(), t.dtype)
        if self.host_ledger is not None:   # released when the backward has dropped the copy
            self.host_ledger.book(ACTIVATIONS, host, pinned=self.device.kind == "cuda")
        host = host.as_strided(t.size(), t.stride())
        token = next(self._tokens)
        self.ledger.alloc(IN_FLIGHT, ("offload", token), nbytes)
        self.events.record("fw_offload_activation")
        self._remember(host, nbytes)
        self.traffic.add("d2h", t.dtype, ACTIVATION_OFFLOAD, nbytes)
        if self.device.kind == "cpu":
            self.host_work.add_work(ACTIVATION_COPY, copy_bytes(t.numel(), t.element_size(), t.element_size()))
            held = [t]       # the runtime's reference to t, dropped as soon as the copy is done

            def copy():
                try:
                    host.copy_(held[0])
                finally:
                    held.clear()
            event = self.stream.submit(copy)
        else:
            event = self.device.copy_async(host, t, self.stream)
        self._offloading.setdefault(layer, []).append((token, event))
        self.stats["offloaded_tensors"] += 1
        self.stats["offloaded_bytes"] += nbytes
        return host

    def wait_offloads(self, layer: str) -> None:
        pending = self._offloading.pop(layer, None)
        if pending is None:
            raise RuntimeError(f"socompile: forward waits for the offloads of {layer}, but none were queued "
                               f"(a missing socompile.offload_activation node)")
        for token, event in pending:
            self.device.wait_on_compute(event)
            self.ledger.free(IN_FLIGHT, ("offload", token))
        self.events.record("fw_offloads_done")

    # ----------------------------------------------------------------------------------------- backward
    @ranges.ranged(ranges.ACTIVATION_FETCH)
    def prefetch(self, layer: str, hosts: list[torch.Tensor]) -> None:
        self.ledger.set_phase("backward")
        self.events.record("bw_prefetch_activations")
        for index, host in enumerate(hosts):
            key = (layer, index)
            if key in self._fetching:
                raise RuntimeError(f"socompile: saved activation {index} of {layer} prefetched twice without a wait")
            self.host_ptrs.pop(host.untyped_storage().data_ptr(), None)
            dst = self.device.empty(host.numel(), host.dtype).as_strided(host.size(), host.stride())
            nbytes = host.numel() * host.element_size()
            self.ledger.alloc(IN_FLIGHT, ("fetch", key), nbytes)
            self.traffic.add("h2d", host.dtype, ACTIVATION_FETCH, nbytes)
            if self.device.kind == "cpu":
                self.host_work.add_work(ACTIVATION_COPY, copy_bytes(host.numel(), host.element_size(),
                                                                    host.element_size()))
            done = self.device.copy_async(dst, host, self.stream)
            self._fetching[key] = (dst, host, done)      # host kept until the wait: the copy reads it
            self.stats["fetched_tensors"] += 1
            self.stats["fetched_bytes"] += nbytes

    def wait(self, layer: str, index: int) -> torch.Tensor:
        entry = self._fetching.pop((layer, index), None)
        if entry is None:
            raise RuntimeError(f"socompile: backward waits for saved activation {index} of {layer}, which was not "
                               f"prefetched (a missing socompile.prefetch_activations node)")
        dst, _host, done = entry
        self.device.wait_on_compute(done)
        self.ledger.free(IN_FLIGHT, ("fetch", (layer, index)))
        self.events.record("bw_wait_activation")
        return dst      # the graph owns it from here; the runtime keeps no reference

    # ------------------------------------------------------------------------------------------- checks
    def drain(self) -> None:
        """Block until every queued copy is done (tests)."""
        self.stream.submit(lambda: None).synchronize()

    def _remember(self, host: torch.Tensor, nbytes: int) -> None:
        self.host_ptrs[host.untyped_storage().data_ptr()] = nbytes
        while len(self.host_ptrs) > _REMEMBERED:      # forwards whose backward never ran: forget the oldest
            self.host_ptrs.popitem(last=False)

    def is_host_copy(self, t: torch.Tensor) -> bool:
        """``t`` is (a view of) a host copy made by an offload whose backward has not fetched it yet."""
        return t.untyped_storage().data_ptr() in self.host_ptrs

    def in_flight(self) -> int:
        return self.ledger.summary()["by_category"].get(IN_FLIGHT, 0)
