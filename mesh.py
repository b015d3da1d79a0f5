"""The 5D rank grid: world = dp * pp * cp * tp, tp varying fastest, and the experts' grid folded over it.

The article's "Putting It All Together" counts N = DP x TP x PP x EP GPUs. The grid here differs in two ways:
context parallelism is an axis of its own (cp ranks split each sequence), and expert parallelism does not
multiply the world: it is folded over each pipeline stage's dp x cp x tp ranks (Megatron-LM's "MoE parallel
folding", torchtitan's expert mesh), so N = DP x PP x CP x TP and EP divides a stage's ranks.

Ranks are laid out as `arange(world).view(dp, pp, cp, tp)`: the dimension that talks most (tp, every layer)
sits on neighbouring ranks, which on a GPU cluster means inside one node (the article's communication
hierarchy), and dp (once per step) spans the farthest. Attention and every dense layer use this grid:

- one group per dimension: the ranks that differ only in that coordinate (dp is also each rank's data rank:
  which slice of the global batch it reads; the cp ranks of one data rank split the same samples' sequence);
- dense (dp x cp): the ranks holding the same dense shard, over which dense gradients are averaged;
- stage (dp x cp x tp): every rank of a pipeline stage;
- sequence (cp x tp): the ranks holding parts of the same sequences (ep.py's balance loss per sequence).

The MoE layers read a stage's ranks, in that row-major order, as expert_dp x ep x expert_tp, expert_tp
fastest (`MeshShape.expert_axis_sizes`, with an example above it): ep spreads the experts (E/ep each,
tokens exchanged by all-to-all), expert_tp splits each expert's matrices, and expert (expert_dp) groups the
ranks holding the same expert shard, over which expert gradients are averaged.

Hybrid sharding (`dp_shard`, `MeshShape.axis_sizes`): ZeRO shards over groups of dp_shard neighbouring
data-parallel ranks and keeps copies across the dp / dp_shard such groups.

`mesh_shape` validates the sizes with no communication at all, so a bad launch fails with the same message
on every rank instead of hanging in a collective. Groups are made with the default group's backends (unless
`backend` says otherwise): on GPUs `cpu:gloo,cuda:nccl`, so every group takes CUDA tensors through NCCL and
CPU tensors through gloo.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

DIMS = ("dp", "pp", "cp", "tp")  # the grid, slowest to fastest
EXPERT_AXES = ("expert_dp", "expert_dp_shard", "ep", "expert_tp")  # the axes only the experts' grid has
GROUPS = {  # group name -> the grid's (or the experts' grid's) axes its ranks differ in
    "dp": ("dp",), "pp": ("pp",), "cp": ("cp",), "tp": ("tp",),
    "dense": ("dp", "cp"),
    "stage": ("dp", "cp", "tp"),
    "sequence": ("cp", "tp"),
    "ep": ("ep",), "expert_tp": ("expert_tp",),
    "expert": ("expert_dp",),
}
HYBRID_GROUPS = {  # made only under hybrid sharding ("dp_shard" and "dp_replicate": the two parts of dp)
    "dense_shard": ("dp_shard", "cp"),
    "expert_shard": ("expert_dp_shard",),
    "dp_replicate": ("dp_replicate",),
}


@dataclass(frozen=True)
class MeshShape:
    dp: int
    pp: int
    cp: int
    tp: int
    ep: int = 1          # folded over each stage's dp x cp x tp ranks: the MoE layers' own split of them
    expert_tp: int = 1
    dp_shard: int = 0  # hybrid sharding: ZeRO's shards span this many neighbouring dp ranks (0: all of them)

    @property
    def world(self):
        return self.dp * self.pp * self.cp * self.tp

    @property
    def stage(self):
        """The ranks of one pipeline stage, which the MoE layers split as expert_dp x ep x expert_tp."""
        return self.dp * self.cp * self.tp

    @property
    def expert_dp(self):
        return self.stage // (self.ep * self.expert_tp)

    @property
    def hybrid(self):
        return 0 < self.dp_shard < self.dp

    def sizes(self):
        return tuple(getattr(self, d) for d in DIMS)

    # Hybrid sharding: dp is read as (dp_replicate, dp_shard), dp_shard the faster. ZeRO's shard groups are the
    # dense and expert groups with dp narrowed to dp_shard ("dense_shard": dp_shard x cp, "expert_shard":
    # expert_dp narrowed to the ranks of one replica); "dp_replicate" holds the copies of the same shards, one
    # in each shard group, which sum them once per step (the same ranks in both grids). For example 16 ranks
    # as dp=8, tp=2 with dp_shard=4 (nodes of 8 GPUs): the shard groups [0, 2, 4, 6], [1, 3, 5, 7],
    # [8, 10, 12, 14], [9, 11, 13, 15] each stay inside a node, and the replicas [0, 8], [2, 10], ... cross:
    #
    #     node 0:  rank  0  1 | 2  3 | 4  5 | 6  7      dp 0..3 (shard 0..3, replica 0)
    #     node 1:  rank  8  9 |10 11 |12 13 |14 15      dp 4..7 (shard 0..3, replica 1)
    def axis_sizes(self):
        """{axis: size} of the grid with dp read as (dp_replicate, dp_shard), slowest first."""
        shard = self.dp_shard or self.dp
        return {"dp_replicate": self.dp // shard, "dp_shard": shard, **{d: getattr(self, d) for d in DIMS[1:]}}

    # The experts' grid: ep takes the stage's fastest ranks after expert_tp, so with tp=8 inside a node ep=8 is
    # the node's 8 GPUs (64 were needed before folding). Every rank of the stage routes tokens no other rank
    # routes (ep.py splits the tokens tp ranks share without sequence parallelism). 8 ranks as dp=2, tp=4, with
    # ep=4 (whole experts, DeepSeek-V3's choice), and with ep=2, expert_tp=2:
    #
    #     rank                 0  1  2  3 | 4  5  6  7
    #     attention  dp        0  0  0  0 | 1  1  1  1     tp groups [0-3], [4-7]
    #     --ep 4     ep        0  1  2  3 | 0  1  2  3     ep groups [0-3], [4-7]; expert [0, 4], [1, 5], ...
    #     --ep 2     ep        0  0  1  1 | 0  0  1  1     ep groups [0, 2], [1, 3], [4, 6], [5, 7]
    #     --expert-tp 2 etp    0  1  0  1 | 0  1  0  1     expert_tp [0, 1], [2, 3], ...; expert [0, 4], [1, 5], ...
    #
    # The unfolded layout (ep an axis of its own between pp and cp, the experts split as tp splits the dense
    # layers) is, without cp, --expert-tp equal to --tp: ep then takes the dp ranks next to the tp group.
    def expert_axis_sizes(self):
        """{axis: size} of the experts' grid, slowest first: pp, then each stage's ranks read as
        (expert_dp, ep, expert_tp), expert_dp itself as (dp_replicate, expert_dp_shard)."""
        replicas = self.axis_sizes()["dp_replicate"]
        return {"pp": self.pp, "dp_replicate": replicas, "expert_dp_shard": self.expert_dp // replicas,
                "ep": self.ep, "expert_tp": self.expert_tp}


def mesh_shape(world, tp=1, pp=1, cp=1, ep=1, expert_tp=1, dp_shard=0):
    """The grid for `world` ranks, dp taking what the other dimensions leave; ep and expert_tp fold over
    each stage's ranks."""
    sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "expert_tp": expert_tp}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {size!r}")
    model_parallel = tp * pp * cp
    if world % model_parallel:
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp = "
            f"{tp}*{pp}*{cp} = {model_parallel}; launch a multiple of {model_parallel} ranks")
    dp = world // model_parallel
    if not isinstance(dp_shard, int) or dp_shard < 0 or dp_shard and dp % dp_shard:
        raise ValueError(f"--dp-shard {dp_shard} must divide the {dp} data-parallel ranks "
                         f"({world} ranks / tp*pp*cp {model_parallel})")
    shape = MeshShape(dp=dp, **sizes, dp_shard=dp_shard)
    if shape.stage % (ep * expert_tp):
        raise ValueError(f"--ep {ep} x --expert-tp {expert_tp} must divide the {shape.stage} ranks of a pipeline "
                         f"stage (dp*cp*tp = {dp}*{cp}*{tp}), over which the experts are folded")
    replicas = shape.axis_sizes()["dp_replicate"]
    if shape.expert_dp % replicas:
        raise ValueError(f"under --dp-shard {dp_shard}, --ep {ep} x --expert-tp {expert_tp} must divide the "
                         f"{shape.stage // replicas} ranks of a stage's shard group (dp_shard*cp*tp), so that "
                         f"the experts' shards have copies in each of the {replicas} replicas")
    return shape


def grid(shape: MeshShape):
    return torch.arange(shape.world).view(*shape.sizes())


def coordinates(shape: MeshShape, rank):
    """This rank's index along each dimension, e.g. {'dp': 1, 'pp': 0, ...}."""
    where = (grid(shape) == rank).nonzero()[0].tolist()
    return dict(zip(DIMS, where))


def _axes(shape: MeshShape, dims):
    """The ranks laid out along the named axes of the grid `dims` belong to: (tensor, {axis: size}), with
    dims read as axes ('dp' is both of its parts, 'expert_dp' both of its own)."""
    parts = {"dp": ("dp_replicate", "dp_shard"), "expert_dp": ("dp_replicate", "expert_dp_shard")}
    dims = [a for d in dims for a in parts.get(d, (d,))]
    if any(d in EXPERT_AXES for d in dims):  # each stage's (dp, cp, tp) ranks, read as the experts' grid
        axes = shape.expert_axis_sizes()
        ranks = torch.arange(shape.world).view(*shape.sizes()).movedim(1, 0)
    else:
        axes = shape.axis_sizes()
        ranks = torch.arange(shape.world)
    return ranks.reshape(*axes.values()), axes, dims


def group_ranks(shape: MeshShape, dims):
    """All groups of ranks that differ only along `dims`, each in row-major (fastest last) order. dims name
    axes of the grid, or of the experts' grid (EXPERT_AXES), or the two parts of dp (axis_sizes)."""
    ranks, axes, dims = _axes(shape, dims)
    names = list(axes)
    moved = ranks.permute(*[names.index(a) for a in names if a not in dims],
                          *[names.index(a) for a in names if a in dims])
    group_size = 1
    for a in dims:
        group_size *= axes[a]
    return [group.tolist() for group in moved.reshape(-1, group_size)]


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
        """This rank's position inside group `name` (e.g. its data rank for 'dp')."""
        return self.ranks[name].index(self.rank)

    def neighbours(self, name):
        """(previous, next) global ranks around the ring or pipeline of group `name`."""
        ranks, i = self.ranks[name], self.index(name)
        return ranks[(i - 1) % len(ranks)], ranks[(i + 1) % len(ranks)]

    def __repr__(self):
        where = " ".join(f"{d}={self.coord[d]}/{getattr(self.shape, d)}" for d in DIMS)
        return f"Mesh(rank {self.rank}: {where}, experts ep={self.index('ep')}/{self.shape.ep})"
