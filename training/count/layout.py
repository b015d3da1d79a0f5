"""The layout: train.py's flags, reduced to what sizes and traffic depend on (Layout, layout_of), and where
a rank sits in its grid (coordinates, expert_coordinates, a stage's places, ZeRO's shard groups)."""
import functools
from dataclasses import dataclass

import pp
from mesh import DIMS, MeshShape
from training import cli


@dataclass(frozen=True)
class Layout:
    world: int
    dp: int
    dp_shard: int          # the dp ranks ZeRO's shards span (mesh.py's dp_shard; dp without hybrid sharding)
    tp: int
    pp: int
    cp: int
    ep: int                # folded over each stage's dp x cp x tp ranks, as expert_tp (mesh.py): no world factors
    expert_tp: int
    zero: int
    sp: bool
    cp_mode: str
    schedule: str
    virtual_stages: int
    micro_batches: int
    batch_size: int        # global, in sequences
    recompute: str
    dtype: str             # train.Precision's weights (so activations and messages), master and reduce dtypes
    master_dtype: str
    reduce_dtype: str
    bucket_bytes: int
    documents: bool = False  # packed documents (--document-mask): attention masked, positions per sequence
    optimizer: str = "adamw"  # --optimizer: "muon" steps the blocks' matrices with Muon (training/muon.py)
    muon_gather: bool = False  # --muon-assembly gather: every holder of a matrix assembles it, not one owner
    fp8: str = None        # --fp8's recipe: the blocks' linears in float8 (training/fp8.py), None: not
    ep_overlap: int = 0    # --ep-overlap: the routed tokens in this many chunks, each exchanged on its own (ep.py)

    @property
    def placement(self):  # which pipeline rank holds which model chunk (pp.py)
        return placement_of(self.schedule, self.pp, self.virtual_stages)

    @property
    def scheduled(self):  # the micro-batches run through pp.py's schedules (train.runs_schedule)
        return self.pp > 1 or self.schedule in pp.ONE_STAGE_TOO

    @property
    def dense_group(self):  # ranks averaging dense gradients (mesh.py's "dense")
        return self.dp * self.cp

    @property
    def stage(self):  # the ranks of a pipeline stage, which the MoE layers read as expert_dp x ep x expert_tp
        return self.dp * self.cp * self.tp

    @property
    def expert_group(self):  # ranks holding the same expert shard, averaging its gradients (mesh.py's "expert")
        return self.stage // (self.ep * self.expert_tp)

    @property
    def replicas(self):  # hybrid sharding: the copies of each ZeRO shard (mesh.py's "dp_replicate"); else 1
        return self.dp // self.dp_shard

    def shard_group(self, kind):
        """The ranks the buckets of `kind` ('dense', 'tied' or 'expert') are padded for and ZeRO shards them
        over: the averaging group, narrowed to one copy's ranks under hybrid sharding (mesh.py's "dense_shard":
        dp_shard x cp; "expert_shard": the expert group's ranks inside one copy, 1/replicas of them)."""
        return self.expert_group // self.replicas if kind == "expert" else self.dp_shard * self.cp

    @property
    def mesh_shape(self):
        return MeshShape(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp, ep=self.ep, expert_tp=self.expert_tp,
                         dp_shard=self.dp_shard)

    @property
    def micro_batch(self):  # sequences a rank computes per micro-batch (dp: the data ranks)
        return self.batch_size // (self.micro_batches * self.dp)

    @property
    def weight_bytes(self):  # the weights, every activation and every message
        return cli.DTYPES[self.dtype].itemsize

    activation_bytes = weight_bytes  # (the same: activations are computed in the weights' dtype)

    @property
    def master_bytes(self):  # the optimizer's weights and moments, ZeRO's gradient shards
        return cli.DTYPES[self.master_dtype].itemsize

    @property
    def reduce_bytes(self):  # the gradient buckets, and their reduction
        return cli.DTYPES[self.reduce_dtype].itemsize


placement_of = functools.lru_cache(maxsize=None)(pp.Placement.of)  # (--search asks for the same ones often)


def layout_of(args, world, data=None):
    """The Layout train.py would build from these flags on `world` ranks (a cli.ConfigError if none); data:
    the data's DataInfo where it has been read."""
    described = data or cli.describe_data(args)  # the data's meta.json, read once for both
    _, shape = cli.check_args(args, world, described)
    return Layout(world=world, dp=shape.dp, dp_shard=shape.dp_shard or shape.dp, tp=shape.tp, pp=shape.pp,
                  cp=shape.cp, ep=shape.ep, expert_tp=shape.expert_tp, zero=args.zero,
                  sp=args.sp, cp_mode=args.cp_mode, schedule=args.schedule, virtual_stages=args.virtual_stages,
                  micro_batches=args.micro_batches, batch_size=args.batch_size, recompute=args.recompute,
                  dtype=args.dtype, master_dtype=args.master_dtype, reduce_dtype=args.reduce_dtype,
                  bucket_bytes=int(args.bucket_mb * 2**20),
                  documents=cli.document_eos(args, data=described) is not None,
                  optimizer=args.optimizer, muon_gather=args.muon_assembly == "gather", fp8=args.fp8,
                  ep_overlap=args.ep_overlap)


def coordinates(layout, rank):
    """{dim: index} of a rank in the grid arange(world).view(dp, pp, cp, tp) (mesh.py), tp fastest."""
    where = {}
    for dim in reversed(DIMS):
        rank, where[dim] = divmod(rank, getattr(layout, dim))
    return where


def rank_of(layout, where):
    """The rank at grid coordinates `where` (coordinates' inverse)."""
    rank = 0
    for dim in DIMS:
        rank = rank * getattr(layout, dim) + where[dim]
    return rank


def first_of_stage(layout, stage):
    """The coordinates of a pipeline stage's first rank (every other coordinate 0)."""
    return {**{dim: 0 for dim in DIMS}, "pp": stage}


def stage_rank(layout, stage, place):
    """The grid coordinates of the rank at `place` in a pipeline stage's group (mesh.py's "stage": its
    dp x cp x tp ranks, row-major)."""
    dp, rest = divmod(place, layout.cp * layout.tp)
    return {"dp": dp, "pp": stage, "cp": rest // layout.tp, "tp": rest % layout.tp}


def stage_place(layout, where):
    """The place of the rank at `where` in its stage's group (stage_rank's inverse)."""
    return (where["dp"] * layout.cp + where["cp"]) * layout.tp + where["tp"]


def expert_coordinates(layout, where):
    """{axis: index} of the rank at `where` in the experts' grid (mesh.py's expert_axis_sizes): its place in
    its stage's dp x cp x tp ranks (row-major) read as (dp_replicate, expert_dp_shard, ep, expert_tp)."""
    place = (where["dp"] * layout.cp + where["cp"]) * layout.tp + where["tp"]
    indices = {}
    for axis, size in reversed(layout.mesh_shape.expert_axis_sizes().items()):
        if axis != "pp":
            place, indices[axis] = divmod(place, size)
    return {"pp": where["pp"], **indices}


def group_index(layout, group, where):
    """A rank's position in ZeRO's shard group of its mesh.py group `group` ('dense', 'expert'), from its
    coordinates, as mesh.group_ranks orders them: for the dense group row-major over (dp, cp), dp's
    coordinate being its place among the dp_shard ranks of its shard group (all of dp without hybrid
    sharding); for the experts' its place among the expert_dp ranks of one copy."""
    if group == "expert":
        return expert_coordinates(layout, where)["expert_dp_shard"]
    return where["dp"] % layout.dp_shard * layout.cp + where["cp"]
