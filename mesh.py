"""The 5D rank grid: world = dp * pp * ep * cp * tp, tp varying fastest.

Ranks are laid out as `arange(world).view(dp, pp, ep, cp, tp)`, so the
dimension that talks most (tp, every layer) sits on neighbouring ranks, which
on a GPU cluster means inside one node, and dp (once per step) spans the
farthest. Every process group is a slice of that grid:

- one group per dimension: the ranks that differ only in that coordinate;
- dense-gradient group (dp x ep x cp): the ranks holding the same dense
  parameter shard, over which dense gradients are averaged;
- expert-gradient group (dp x cp): the ranks holding the same expert shard;
- data rank = index in dp x ep: which slice of the global batch a rank reads
  (the cp ranks of one data rank read the same samples and split the sequence).

Hybrid sharding (`dp_shard`): ZeRO shards over groups of dp_shard
neighbouring data-parallel ranks and keeps copies across the dp / dp_shard
such groups, dp being read as (dp_replicate, dp_shard), dp_shard the faster:

- ZeRO's shard groups: the dense and expert groups with dp narrowed to
  dp_shard ("dense_shard": dp_shard x ep x cp, "expert_shard": dp_shard x cp);
- "dp_replicate": the ranks holding copies of the same shards, one in each
  shard group, which sum them once per step.

For example 16 ranks as dp=8, tp=2 with dp_shard=4 (nodes of 8 GPUs): ranks
0-7 are one node, dp ranks 0-3 of it; the shard groups are [0, 2, 4, 6],
[1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15], each inside a node, and the
replicas [0, 8], [2, 10], ... cross the nodes:

    node 0:  rank  0  1 | 2  3 | 4  5 | 6  7      dp 0..3 (shard 0..3, replica 0)
    node 1:  rank  8  9 |10 11 |12 13 |14 15      dp 4..7 (shard 0..3, replica 1)

`mesh_shape` validates the sizes with no communication at all, so a bad
launch fails with the same message on every rank instead of hanging in a
collective.

Groups are made with the default group's backends (unless `backend` says
otherwise): on GPUs that is `cpu:gloo,cuda:nccl`, so every group takes CUDA
tensors through NCCL and CPU tensors through gloo.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

DIMS = ("dp", "pp", "ep", "cp", "tp")  # slowest to fastest
GROUPS = {  # group name -> the grid dimensions its ranks differ in
    "dp": ("dp",), "pp": ("pp",), "ep": ("ep",), "cp": ("cp",), "tp": ("tp",),
    "dense": ("dp", "ep", "cp"),
    "expert": ("dp", "cp"),
    "data": ("dp", "ep"),
}
HYBRID_GROUPS = {  # made only under hybrid sharding ("dp_shard" and "dp_replicate": the two parts of dp)
    "dense_shard": ("dp_shard", "ep", "cp"),
    "expert_shard": ("dp_shard", "cp"),
    "dp_replicate": ("dp_replicate",),
}


@dataclass(frozen=True)
class MeshShape:
    dp: int
    pp: int
    ep: int
    cp: int
    tp: int
    dp_shard: int = 0  # hybrid sharding: ZeRO's shards span this many neighbouring dp ranks (0: all of them)

    @property
    def world(self):
        return self.dp * self.pp * self.ep * self.cp * self.tp

    @property
    def hybrid(self):
        return 0 < self.dp_shard < self.dp

    def sizes(self):
        return tuple(getattr(self, d) for d in DIMS)

    def axis_sizes(self):
        """{axis: size} of the grid with dp read as (dp_replicate, dp_shard), slowest first."""
        shard = self.dp_shard or self.dp
        return {"dp_replicate": self.dp // shard, "dp_shard": shard, **{d: getattr(self, d) for d in DIMS[1:]}}


def mesh_shape(world, tp=1, pp=1, cp=1, ep=1, dp_shard=0):
    """The grid for `world` ranks, dp taking what the other dimensions leave."""
    sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"--{name} must be a positive integer, got {size!r}")
    model_parallel = tp * pp * cp * ep
    if world % model_parallel:
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp*ep = "
            f"{tp}*{pp}*{cp}*{ep} = {model_parallel}; launch a multiple of {model_parallel} ranks")
    dp = world // model_parallel
    if not isinstance(dp_shard, int) or dp_shard < 0 or dp_shard and dp % dp_shard:
        raise ValueError(f"--dp-shard {dp_shard} must divide the {dp} data-parallel ranks "
                         f"({world} ranks / tp*pp*cp*ep {model_parallel})")
    return MeshShape(dp=dp, **sizes, dp_shard=dp_shard)


def grid(shape: MeshShape):
    return torch.arange(shape.world).view(*shape.sizes())


def coordinates(shape: MeshShape, rank):
    """This rank's index along each dimension, e.g. {'dp': 1, 'pp': 0, ...}."""
    where = (grid(shape) == rank).nonzero()[0].tolist()
    return dict(zip(DIMS, where))


def group_ranks(shape: MeshShape, dims):
    """All groups of ranks that differ only along `dims`, each in row-major (tp fastest) order. dims name
    grid dimensions, or the two parts of dp (axis_sizes): 'dp' is both."""
    axes = shape.axis_sizes()
    dims = [a for d in dims for a in (("dp_replicate", "dp_shard") if d == "dp" else (d,))]
    names = list(axes)
    moved = torch.arange(shape.world).view(*axes.values()).permute(
        *[names.index(a) for a in names if a not in dims], *[names.index(a) for a in names if a in dims])
    group_size = 1
    for a in dims:
        group_size *= axes[a]
    return [ranks.tolist() for ranks in moved.reshape(-1, group_size)]


class Mesh:
    """This rank's place in the grid and its process groups (call on every rank)."""

    def __init__(self, shape: MeshShape, backend=None, timeout=None):
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs torch.distributed to be initialised first")
        if dist.get_world_size() != shape.world:
            raise ValueError(f"mesh of {shape.world} ranks launched on {dist.get_world_size()}")
        self.shape, self.backend, self.timeout = shape, backend, timeout
        self.rank = dist.get_rank()
        self.coord = coordinates(shape, self.rank)
        self.groups, self.ranks = {}, {}
        self._add_groups(GROUPS)
        if shape.hybrid:
            self._add_groups(HYBRID_GROUPS)

    def _add_groups(self, groups):
        for name, dims in groups.items():
            # Every rank must create every group, in the same order.
            for ranks in group_ranks(self.shape, dims):
                group = dist.new_group(ranks, backend=self.backend, timeout=self.timeout)
                if self.rank in ranks:
                    self.groups[name], self.ranks[name] = group, ranks

    def zero_groups(self, name):
        """ZeRO's groups for the gradients averaged over group `name` ('dense' or 'expert'): (the ranks
        its shards span, the ranks holding copies of this rank's shard), the latter None without hybrid
        sharding (the shards then span the whole group)."""
        if not self.shape.hybrid:
            return self.groups[name], None
        return self.groups[f"{name}_shard"], self.groups["dp_replicate"]

    def add_pipeline_ends(self):
        """The group of each pipeline's first and last stage (Megatron-LM's embedding group, where a tied
        output layer's two copies live), as groups["pp_ends"]; made only when needed (call on every rank)."""
        for ranks in group_ranks(self.shape, ("pp",)):
            ends = [ranks[0], ranks[-1]]
            group = dist.new_group(ends, backend=self.backend, timeout=self.timeout)
            if self.rank in ends:
                self.groups["pp_ends"], self.ranks["pp_ends"] = group, ends

    def size(self, name):
        return len(self.ranks[name])

    def index(self, name):
        """This rank's position inside group `name` (e.g. its data rank for 'data')."""
        return self.ranks[name].index(self.rank)

    def neighbours(self, name):
        """(previous, next) global ranks around the ring or pipeline of group `name`."""
        ranks, i = self.ranks[name], self.index(name)
        return ranks[(i - 1) % len(ranks)], ranks[(i + 1) % len(ranks)]

    def __repr__(self):
        where = " ".join(f"{d}={self.coord[d]}/{getattr(self.shape, d)}" for d in DIMS)
        return f"Mesh(rank {self.rank}: {where})"
