"""Buckets (dp.py): gradients in backward order, about bucket_bytes each, padded to a multiple of the group;
ZeRO-3's units."""
import bisect
import functools
import itertools
import math
from dataclasses import dataclass


@dataclass
class Bucket:
    sizes: list   # elements of each parameter, in bucket order
    padded: int   # elements, a multiple of the group's size

    def __post_init__(self):
        self.offsets = [0, *itertools.accumulate(self.sizes)]  # where each parameter begins, and the end

    def pieces(self, rank, n_ranks):
        """How many parameters overlap ZeRO rank `rank`'s shard [r S, (r+1) S) of this bucket."""
        shard = self.padded // n_ranks
        lo, hi = rank * shard, (rank + 1) * shard
        first = bisect.bisect_right(self.offsets, lo) - 1  # the parameter in which the shard begins
        last = bisect.bisect_left(self.offsets, hi)        # one past the parameter in which it ends
        return sum(1 for i in range(max(first, 0), min(last, len(self.sizes)))
                   if min(self.offsets[i + 1], hi) > max(self.offsets[i], lo))


def padded(numel, n_ranks):
    return math.ceil(numel / n_ranks) * n_ranks


@functools.lru_cache(maxsize=4096)
def make_buckets(sizes, bucket_bytes, itemsize, n_ranks):
    """As dp.make_buckets: in backward (reverse) order, a new bucket once one holds bucket_bytes or more.
    (sizes: a tuple; the buckets are shared by every call alike: read only.)"""
    buckets, current = [], []
    for size in reversed(sizes):
        if current and sum(current) * itemsize >= bucket_bytes:
            buckets.append(current)
            current = []
        current.append(size)
    if current:
        buckets.append(current)
    return tuple(Bucket(b, padded(sum(b), n_ranks)) for b in buckets)


def unit_of(name):
    """The ZeRO-3 unit (dp.gpt_units) a parameter belongs to: 'blocks.3', or 'tok_emb', 'norm', ..."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


@functools.lru_cache(maxsize=4096)
def zero3_buckets(params, n_ranks):
    """ZeRO-3's buckets are its units (embeddings, each block, final norm, head), in reverse. (params: a tuple
    of (name, elements); the buckets are shared: read only.)"""
    units = {}
    for name, numel in params:
        units.setdefault(unit_of(name), []).append(numel)
    return tuple(Bucket(sizes, padded(sum(sizes), n_ranks)) for sizes in reversed(list(units.values())))
