"""The rank grid is the one DESIGN.md describes, the experts' grid is folded over each stage's ranks, and bad
sizes are refused before any communication."""
import itertools

import pytest
import torch.distributed as dist

from distributed import run_on_ranks
from mesh import DIMS, EXPERT_AXES, GROUPS, HYBRID_GROUPS, Mesh, MeshShape, coordinates, group_ranks, mesh_shape

SHAPES = [MeshShape(dp=2, pp=1, cp=1, tp=2), MeshShape(dp=1, pp=2, cp=2, tp=1, ep=2),
          MeshShape(dp=2, pp=2, cp=2, tp=2, ep=2, expert_tp=2), MeshShape(dp=6, pp=1, cp=1, tp=1, ep=2),
          MeshShape(dp=2, pp=2, cp=1, tp=4, ep=4), MeshShape(dp=1, pp=1, cp=2, tp=4, ep=2, expert_tp=4)]


def rank_of(shape, coord):
    """Mixed-radix rank with tp varying fastest, then cp, pp, dp (written independently of mesh.grid)."""
    rank = 0
    for d in DIMS:
        rank = rank * getattr(shape, d) + coord[d]
    return rank


def all_coords(shape):
    for values in itertools.product(*[range(getattr(shape, d)) for d in DIMS]):
        yield dict(zip(DIMS, values))


def expert_coords(shape, coord):
    """A rank's place in the experts' grid, by hand: its index among its stage's ranks (dp, cp, tp row-major)
    read as (expert_dp, ep, expert_tp), expert_tp fastest."""
    local = (coord["dp"] * shape.cp + coord["cp"]) * shape.tp + coord["tp"]
    return dict(pp=coord["pp"], expert_dp=local // (shape.ep * shape.expert_tp),
                ep=local // shape.expert_tp % shape.ep, expert_tp=local % shape.expert_tp)


def test_small_grid_by_hand():
    """8 ranks as dp=2, tp=2, cp=2: tp pairs are neighbours, cp pairs two apart, dp four apart."""
    shape = mesh_shape(8, tp=2, cp=2)
    assert shape == MeshShape(dp=2, pp=1, cp=2, tp=2)
    assert group_ranks(shape, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(shape, ("cp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(shape, ("dp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(shape, GROUPS["dense"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert coordinates(shape, 6) == dict(dp=1, pp=0, cp=1, tp=0)


def test_the_docstring_picture_of_folded_experts():
    """8 ranks as dp=2, tp=4: ep=4 takes each tp group; ep=2 with expert-tp=2 takes every other rank of it."""
    whole = mesh_shape(8, tp=4, ep=4)
    assert group_ranks(whole, GROUPS["ep"]) == group_ranks(whole, GROUPS["tp"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group_ranks(whole, GROUPS["expert"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    split = mesh_shape(8, tp=4, ep=2, expert_tp=2)
    assert group_ranks(split, GROUPS["ep"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(split, GROUPS["expert_tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(split, GROUPS["expert"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_the_unfolded_layout_is_expert_tp_equal_to_tp():
    """Before folding, 8 ranks with tp=2, ep=2 were arange(8).view(dp=2, ep=2, tp=2): the experts spread over
    data-parallel ranks two apart, split over tp. Folded, --expert-tp 2 gives those very groups."""
    shape = mesh_shape(8, tp=2, ep=2, expert_tp=2)
    assert group_ranks(shape, GROUPS["ep"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(shape, GROUPS["expert_tp"]) == group_ranks(shape, GROUPS["tp"])
    assert group_ranks(shape, GROUPS["expert"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_group_is_a_slice_of_the_grid(shape):
    for name, dims in GROUPS.items():
        groups = group_ranks(shape, dims)
        assert sorted(r for g in groups for r in g) == list(range(shape.world)), f"{name} must partition the world"
        experts = any(d in EXPERT_AXES for d in dims)
        for coord in all_coords(shape):
            rank = rank_of(shape, coord)
            assert coordinates(shape, rank) == coord
            mine = next(g for g in groups if rank in g)
            # The members are exactly the ranks that differ from this one only along `dims`, listed in the
            # order of those coordinates (so index in 'dp' is the data rank); the experts' groups likewise
            # in the experts' grid.
            if experts:
                place = {r: expert_coords(shape, c) for c in all_coords(shape) for r in [rank_of(shape, c)]}
                fixed = {k: v for k, v in place[rank].items() if k not in dims}
                expected = sorted((r for r, c in place.items() if all(c[k] == v for k, v in fixed.items())),
                                  key=lambda r: [place[r][d] for d in dims])
            else:
                expected = [rank_of(shape, {**coord, **dict(zip(dims, values))})
                            for values in itertools.product(*[range(getattr(shape, d)) for d in dims])]
            assert mine == expected, name


@pytest.mark.parametrize("world,flags,message", [
    (6, dict(tp=4), "not divisible by tp*pp*cp"),
    (8, dict(tp=2, pp=3), "launch a multiple of 6 ranks"),
    (4, dict(cp=0), "--cp must be a positive integer"),
    (4, dict(expert_tp=0), "--expert-tp must be a positive integer"),
    (8, dict(tp=2, pp=2, ep=8), "--ep 8 x --expert-tp 1 must divide the 4 ranks of a pipeline stage"),
    (12, dict(ep=3, expert_tp=2, dp_shard=4), "under --dp-shard 4, --ep 3 x --expert-tp 2 must divide the 4 ranks"),
])
def test_bad_sizes_say_what_is_wrong(world, flags, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        mesh_shape(world, **flags)


def mesh_worker(flags):
    """Each group really connects its members: the sum of their ranks over the group matches."""
    import torch
    mesh = Mesh(mesh_shape(dist.get_world_size(), **flags))
    out = {}
    for name in GROUPS:
        t = torch.tensor([float(mesh.rank)])
        dist.all_reduce(t, group=mesh.groups[name])
        out[name] = (mesh.ranks[name], t.item(), mesh.index(name))
    out["neighbours"] = mesh.neighbours("pp"), mesh.neighbours("cp")
    return mesh.rank, out


def test_process_groups_on_eight_ranks():
    flags = dict(pp=2, ep=2, cp=2)
    shape = mesh_shape(8, **flags)
    for rank, out in run_on_ranks(8, mesh_worker, flags, timeout=180):
        for name, dims in GROUPS.items():
            ranks, total, index = out[name]
            assert ranks == next(g for g in group_ranks(shape, dims) if rank in g)
            assert total == sum(ranks)
            assert ranks[index] == rank
        (pp_prev, pp_next), (cp_prev, cp_next) = out["neighbours"]
        assert pp_next == pp_prev == rank ^ 2  # pp=2: the other stage is 2 ranks away (cp*tp = 2)
        assert cp_next == cp_prev == rank ^ 1  # cp=2, tp=1: neighbouring ranks


def test_hybrid_sharding_splits_dp_into_neighbouring_shard_groups_and_replicas():
    """The docstring's picture: 16 ranks as dp=8, tp=2 with dp_shard=4 on nodes of 8. A shard group is the
    dense group narrowed to 4 neighbouring dp ranks (inside a node); the replicas hold the same position in
    each shard group; together they cover every rank of the dense group once."""
    shape = mesh_shape(16, tp=2, dp_shard=4)
    assert shape.hybrid and shape.axis_sizes()["dp_replicate"] == 2
    shards = group_ranks(shape, HYBRID_GROUPS["dense_shard"])
    assert shards == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert all(max(g) // 8 == min(g) // 8 for g in shards)  # each inside a node of 8
    replicas = group_ranks(shape, HYBRID_GROUPS["dp_replicate"])
    assert replicas == [[r, r + 8] for r in range(8)]
    for dense in group_ranks(shape, GROUPS["dense"]):
        assert sorted(r for g in shards if g[0] in dense for r in g) == dense
    # Experts (ep=2, folded over the shard group's neighbours): an expert shard's group leaves out ep, and its
    # replicas are the dense ones; dp_shard equal to dp is no hybrid.
    moe = mesh_shape(16, ep=2, dp_shard=4)
    assert group_ranks(moe, HYBRID_GROUPS["expert_shard"])[:2] == [[0, 2], [1, 3]]
    assert group_ranks(moe, HYBRID_GROUPS["dense_shard"])[0] == [0, 1, 2, 3]
    assert group_ranks(moe, HYBRID_GROUPS["dp_replicate"])[0] == [0, 4, 8, 12]
    assert not mesh_shape(16, tp=2, dp_shard=8).hybrid
    with pytest.raises(ValueError, match="--dp-shard 3 must divide the 8 data-parallel ranks"):
        mesh_shape(16, tp=2, dp_shard=3)


def hybrid_worker():
    mesh = Mesh(mesh_shape(dist.get_world_size(), ep=2, dp_shard=2))
    out = {}
    for name in ("dense", "expert"):
        shard, replicas = mesh.zero_groups(name)
        out[name] = (dist.get_process_group_ranks(shard), dist.get_process_group_ranks(replicas))
    return mesh.rank, out


def test_zero_groups_connect_the_shard_groups_and_their_replicas_on_eight_ranks():
    shape = mesh_shape(8, ep=2, dp_shard=2)
    for rank, out in run_on_ranks(8, hybrid_worker, timeout=180):
        for name in ("dense", "expert"):
            shard, replicas = out[name]
            assert shard == next(g for g in group_ranks(shape, HYBRID_GROUPS[f"{name}_shard"]) if rank in g)
            assert replicas == next(g for g in group_ranks(shape, HYBRID_GROUPS["dp_replicate"]) if rank in g)
