"""Ring attention's memory and time by sequence length: cp.py's three ways on a rank pair, and SDPA of the
whole sequence on one rank."""
import json
import statistics
import time

from tools.bench.common import ENV, status_kib, torchrun, worker_result


def worker_attention(settings):
    """One causal attention forward and backward over settings["length"] tokens in float32: one of cp.py's
    three ways (ring attention, with the fused or the explicit blocks; all-gathered K and V; the all-to-all
    to head shards) on this launch's ranks, or SDPA of the whole sequence on one rank.
    The memory is the peak resident memory above what the process held before (Linux: /proc/self/clear_refs
    resets the peak; every allocation of 64 KiB or more is its own mapping, given back when freed, so the
    resident memory follows what is allocated), the most over ranks; the time the slowest rank's; the bytes
    a rank sent. Each is the median of a few rounds after one to warm up (first calls set up kernels and
    buffers)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import cp
    rank, n = dist.get_rank(), dist.get_world_size()
    shape = (1, settings["heads"], settings["length"] // n, settings["head_dim"])
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    times, peaks, sent = [], [], []
    for _ in range(settings["rounds"] + 1):
        q.grad = k.grad = v.grad = None
        cp.comm_bytes.clear()
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts again from the current one
        before, start = status_kib("VmRSS"), time.perf_counter()
        if settings["kernels"] == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out, _ = cp.MODES[settings["mode"]](q, k, v, None, kernels=getattr(cp, settings["kernels"].upper()))
        out.backward(torch.ones_like(out))
        measured = torch.tensor([time.perf_counter() - start, (status_kib("VmHWM") - before) * 1024.0,
                                 float(sum(cp.comm_bytes.values()))], dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        times.append(measured[0].item())
        peaks.append(measured[1].item())
        sent.append(measured[2].item())
    return dict(seconds=statistics.median(times[1:]), peak_bytes=statistics.median(peaks[1:]),
                bytes_sent=statistics.median(sent[1:]))


# The attention benchmark's arms: row key -> (cp.py's way, its block kernels, ranks).
ATTENTION_ARMS = {"fused": ("ring", "fused", 2), "explicit": ("ring", "explicit", 2),
                  "allgather": ("allgather", "fused", 2), "alltoall": ("alltoall", "fused", 2),
                  "sdpa": (None, "sdpa", 1)}


def attention_by_length(lengths, heads=4, head_dim=64, rounds=3):
    """cp.py's three ways on one rank pair (ring attention with fused and with explicit blocks, the all-gather
    and the all-to-all with fused blocks), and SDPA of the whole sequence on one rank, at each length in
    turn (one fresh launch each): memory, time and bytes sent of a forward and backward."""
    results = []
    for length in lengths:
        row = dict(length=length)
        for name, (mode, kernels, ranks) in ATTENTION_ARMS.items():
            print(f"bench: attention, {length} tokens, {name}", flush=True)
            settings = dict(length=length, mode=mode, kernels=kernels, heads=heads, head_dim=head_dim, rounds=rounds)
            stdout = torchrun(ranks, "-m", "tools.bench", "--worker", "attention", "--settings", json.dumps(settings),
                              env=dict(ENV, MALLOC_MMAP_THRESHOLD_="65536"))
            row[name] = worker_result(stdout)
        results.append(row)
    return dict(heads=heads, head_dim=head_dim, dtype="float32", batch=1, rounds=rounds, rows=results)
