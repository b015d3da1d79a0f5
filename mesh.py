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


@dataclass(frozen=True)
class MeshShape:
    dp: int
    pp: int
    ep: int
    cp: int
    tp: int

    @property
    def world(self):
        return self.dp * self.pp * self.ep * self.cp * self.tp

    def sizes(self):
        return tuple(getattr(self, d) for d in DIMS)


def mesh_shape(world, tp=1, pp=1, cp=1, ep=1):
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
    return MeshShape(dp=world // model_parallel, **sizes)


def grid(shape: MeshShape):
    return torch.arange(shape.world).view(*shape.sizes())


def coordinates(shape: MeshShape, rank):
    """This rank's index along each dimension, e.g. {'dp': 1, 'pp': 0, ...}."""
    where = (grid(shape) == rank).nonzero()[0].tolist()
    return dict(zip(DIMS, where))


def group_ranks(shape: MeshShape, dims):
    """All groups of ranks that differ only along `dims`, each in row-major (tp fastest) order."""
    moved = grid(shape).permute(*[DIMS.index(d) for d in DIMS if d not in dims],
                                *[DIMS.index(d) for d in DIMS if d in dims])
    group_size = 1
    for d in dims:
        group_size *= getattr(shape, d)
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
        for name, dims in GROUPS.items():
            # Every rank must create every group, in the same order.
            for ranks in group_ranks(shape, dims):
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                if self.rank in ranks:
                    self.groups[name], self.ranks[name] = group, ranks

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
