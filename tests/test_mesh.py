"""The rank grid is the one DESIGN.md describes, and bad sizes are refused before any communication."""
import itertools

import pytest
import torch.distributed as dist

from distributed import run_on_ranks
from mesh import DIMS, GROUPS, HYBRID_GROUPS, Mesh, MeshShape, coordinates, group_ranks, mesh_shape

SHAPES = [MeshShape(dp=2, pp=1, ep=1, cp=1, tp=2), MeshShape(dp=1, pp=2, ep=2, cp=2, tp=1),
          MeshShape(dp=2, pp=2, ep=2, cp=2, tp=2), MeshShape(dp=3, pp=1, ep=2, cp=1, tp=1)]


def rank_of(shape, coord):
    """Mixed-radix rank with tp varying fastest, then cp, ep, pp, dp (written independently of mesh.grid)."""
    rank = 0
    for d in DIMS:
        rank = rank * getattr(shape, d) + coord[d]
    return rank


def all_coords(shape):
    for values in itertools.product(*[range(getattr(shape, d)) for d in DIMS]):
        yield dict(zip(DIMS, values))


def test_small_grid_by_hand():
    """8 ranks as dp=2, tp=2, cp=2: tp pairs are neighbours, cp pairs two apart, dp four apart."""
    shape = mesh_shape(8, tp=2, cp=2)
    assert shape == MeshShape(dp=2, pp=1, ep=1, cp=2, tp=2)
    assert group_ranks(shape, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(shape, ("cp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(shape, ("dp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(shape, GROUPS["dense"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert coordinates(shape, 6) == dict(dp=1, pp=0, ep=0, cp=1, tp=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_group_is_a_slice_of_the_grid(shape):
    for name, dims in GROUPS.items():
        groups = group_ranks(shape, dims)
        assert sorted(r for g in groups for r in g) == list(range(shape.world)), f"{name} must partition the world"
        for coord in all_coords(shape):
            rank = rank_of(shape, coord)
            assert coordinates(shape, rank) == coord
            mine = next(g for g in groups if rank in g)
            # The members are exactly the ranks that differ from this one only along `dims`,
            # listed in the order of those coordinates (so index in 'data' = dp * ep_size + ep).
            expected = [rank_of(shape, {**coord, **dict(zip(dims, values))})
                        for values in itertools.product(*[range(getattr(shape, d)) for d in dims])]
            assert mine == expected, name


@pytest.mark.parametrize("world,flags,message", [
    (6, dict(tp=4), "not divisible by tp*pp*cp*ep"),
    (8, dict(tp=2, pp=3), "launch a multiple of 6 ranks"),
    (4, dict(cp=0), "--cp must be a positive integer"),
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
        assert pp_next == pp_prev == rank ^ 4  # pp=2: the other stage is 4 ranks away (ep*cp*tp = 4)
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
    # Experts (ep=2): the shard group of an expert shard leaves out ep; dp_shard equal to dp is no hybrid.
    moe = mesh_shape(16, ep=2, dp_shard=2)
    assert group_ranks(moe, HYBRID_GROUPS["expert_shard"])[:2] == [[0, 2], [1, 3]]
    assert group_ranks(moe, HYBRID_GROUPS["dense_shard"])[0] == [0, 1, 2, 3]
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
