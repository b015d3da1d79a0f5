"""Counting memory exactly, from the tensors that exist.

The article's memory table (16 bytes per parameter, and how ZeRO divides it)
is about parameters, gradients and optimizer state; activations come on top.
Here each is counted from real tensors, so the numbers are exact and the
same on a CPU as on a GPU:

- parameters, gradients, optimizer state: the bytes of their storages, each
  storage counted once (a gradient that is a view into a flat bucket counts
  the bucket);
- peaks: the process's resident memory (VmHWM) and, on a GPU, the allocator's
  peak, each since the process started (construction included);
- activations: the tensors autograd saves for backward, seen through
  `torch.autograd.graph.saved_tensors_hooks`. A saved tensor is live from the
  forward that saves it until the backward that frees its graph; the meter
  keeps the running total and its peak. Parameters saved for backward (or
  views of them, like a transposed weight) are not activations and are left
  out; they are recognised by identity, not by address, because ZeRO-3
  moves a parameter's memory each time it gathers it.
"""
import os

import torch


def peak_resident_bytes():
    """This process's peak resident memory since it started, in bytes: Linux's VmHWM (0 elsewhere). It
    holds everything the process touched: the interpreter, PyTorch's libraries, the allocator's caches."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except OSError:
        return 0


def resident_bytes():
    """This process's resident memory now, in bytes: Linux's VmRSS (0 elsewhere). What it counts of the shared
    libraries depends on the machine's page cache (a library's pages collapsed into huge pages count whole), so
    a figure compared with it is measured in the same process."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except OSError:
        return 0


def device_memory_bytes():
    """The memory of this rank's device: its GPU's (LOCAL_RANK's), or on the CPU the machine's, shared by the
    ranks torchrun started on it (LOCAL_WORLD_SIZE)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def device_peak_bytes(device):
    """The most memory PyTorch's allocator held for tensors on a CUDA device since the process started (0
    on a CPU, where peak_resident_bytes tells)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def storage_key(t):
    return (t.device, t.untyped_storage().data_ptr())


def tensor_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`."""
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def parameter_bytes(params):
    return tensor_bytes(list(params))


def gradient_bytes(params):
    return tensor_bytes([p.grad for p in params])


def optimizer_bytes(optimizer):
    return tensor_bytes([v for state in optimizer.state.values() for v in state.values()
                         if torch.is_tensor(v)])


class _Saved:
    """What autograd keeps in place of a saved tensor; its deletion frees the bytes."""

    def __init__(self, meter, tensor):
        self.meter, self.tensor, self.key = meter, tensor, storage_key(tensor)
        meter._acquire(self.key, tensor.untyped_storage().nbytes())

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """Live and peak bytes of the activations saved for backward, inside `with meter:`."""

    def __init__(self, params=()):
        self.param_ids = {id(p) for p in params}
        self.refs, self.sizes = {}, {}
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        if id(tensor) in self.param_ids or id(tensor._base) in self.param_ids:
            return tensor
        # Detached: the same storage, without the autograd history. Kept with its history, a tensor that
        # its own graph node saves (an output) would hold that node, which holds it, and a graph kept for a
        # second backward (retain_graph) would never be freed.
        return _Saved(self, tensor.detach())

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _acquire(self, key, nbytes):
        if self.refs.get(key, 0) == 0:
            self.sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1

    def _release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def reset_peak(self):
        self.peak = self.live

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
