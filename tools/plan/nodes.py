"""Inside a node or across nodes: which groups a rank's traffic travels in (mesh.py's grid, ranks of a node
consecutive), and where the experts of an ep group lie."""
from typing import NamedTuple

from mesh import DIMS, EXPERT_AXES
from training.count.layout import expert_coordinates, rank_of
from tools.plan.prediction import rank_traffic


TRAFFIC_GROUPS = {  # the axes each group of traffic spans (mesh.py's grid, dp read as (dp_replicate, dp_shard), or
    # the experts' grid folded over each stage's ranks, mesh.EXPERT_AXES; see LOGGED_UNDER for their names in the log)
    "dense": ("dp_shard", "cp"), "expert": ("expert_dp_shard",),  # all of dp (expert_dp) without hybrid sharding
    "dense_replicas": ("dp_replicate",), "expert_replicas": ("dp_replicate",),
    "tp": ("tp",), "pp": ("pp",), "cp": ("cp",), "ep": ("ep",),
    "tp_rows": ("tp",), "expert_tp": ("expert_tp",), "expert_tp_bias": ("expert_tp",),
    "optim": ("dp", "cp", "tp"),  # Muon's assembly of the matrices: a stage's ranks (mesh.py's "stage")
    "fp8": ("tp",), "fp8_expert_tp": ("expert_tp",)}  # the float8 scales' maxima (training/fp8.py)


def grid_coordinates(layout, where, experts=False):
    """{axis: (size, the rank's index)} of mesh.py's grid arange(world).view(dp_replicate, dp_shard, pp, cp, tp),
    slowest first, for the rank at `where` (its coordinates in dp, pp, cp, tp); with `experts`, of the experts'
    grid (pp, dp_replicate, expert_dp_shard, ep, expert_tp), each stage's ranks read in their order."""
    if experts:
        sizes, indices = layout.mesh_shape.expert_axis_sizes(), expert_coordinates(layout, where)
    else:
        sizes = layout.mesh_shape.axis_sizes()
        indices = {"dp_replicate": where["dp"] // layout.dp_shard, "dp_shard": where["dp"] % layout.dp_shard,
                   **{dim: where[dim] for dim in DIMS[1:]}}
    return {axis: (size, indices[axis]) for axis, size in sizes.items()}


def grid_axes(axes):
    """The grid's axes a group spans ('dp' is both parts, 'expert_dp' both of its own), and whether they are
    the experts' grid's."""
    parts = {"dp": ("dp_replicate", "dp_shard"), "expert_dp": ("dp_replicate", "expert_dp_shard")}
    axes = {part for axis in axes for part in parts.get(axis, (axis,))}
    return axes, any(axis in EXPERT_AXES for axis in axes)


def expert_place_rank(layout, place):
    """The rank at a place of the experts' grid (pp-major, then each stage's ranks in order): (dp, pp, cp x tp)
    row-major."""
    stage, cp_tp = layout.stage, layout.cp * layout.tp
    return (place % stage // cp_tp * layout.pp + place // stage) * cp_tp + place % cp_tp


def crosses_nodes(layout, where, axes, gpus_per_node):
    """Whether the group of the rank at `where` spanning `axes` (grid_coordinates' names; 'dp' is both parts,
    'expert_dp' both of its own) holds ranks of more than one node: a node holds consecutive ranks, and the
    group's lie between its lowest (its axes' indices 0) and its highest (their last)."""
    axes, experts = grid_axes(axes)
    stride, lowest, span = 1, 0, 0
    for axis, (size, index) in reversed(grid_coordinates(layout, where, experts).items()):
        if axis in axes:
            span += (size - 1) * stride
        else:
            lowest += index * stride
        stride *= size
    ends = [lowest, lowest + span]
    if experts:  # a place in the experts' grid to its rank
        ends = [expert_place_rank(layout, place) for place in ends]
    return ends[0] // gpus_per_node != ends[1] // gpus_per_node


def group_members(layout, where, axes):
    """The ranks of the group of the rank at `where` spanning `axes`, in the order of their indices along them
    (mesh.group_ranks' order: for ep, ep rank 0 first)."""
    axes, experts = grid_axes(axes)
    stride, lowest, offsets = 1, 0, [0]
    for axis, (size, index) in reversed(grid_coordinates(layout, where, experts).items()):
        if axis in axes:
            offsets = [i * stride + offset for i in range(size) for offset in offsets]
        else:
            lowest += index * stride
        stride *= size
    places = sorted(lowest + offset for offset in offsets)
    return [expert_place_rank(layout, place) for place in places] if experts else places


# Groups whose traffic is an all-to-all sending each peer as much (balanced routing's rows): the share going to
# peers on the rank's own node stays inside it. (A ring collective's group that crosses nodes is counted across.)
EVEN_ALL_TO_ALL = ("ep", "tp_rows", "expert_tp")


def inside_share(layout, where, axes, gpus_per_node):
    """(peers on the node of the rank at `where`, peers) in its group spanning `axes`."""
    me, members = rank_of(layout, where), group_members(layout, where, axes)
    peers = [rank for rank in members if rank != me]
    return sum(rank // gpus_per_node == me // gpus_per_node for rank in peers), len(peers)


def node_split(layout, stage_prediction, where, gpus_per_node):
    """(bytes sent per step inside the node, across nodes) by the rank at `where`: a group's traffic inside when
    the group lies in the rank's node, else across, but for the all-to-alls of EVEN_ALL_TO_ALL, split by where
    the peers are."""
    inside = across = 0
    for group, counter in rank_traffic(stage_prediction, layout, where).items():
        sent, axes = sum(counter.values()), TRAFFIC_GROUPS[group]
        if not sent:
            continue
        if not crosses_nodes(layout, where, axes, gpus_per_node):
            inside += sent
            continue
        near, peers = inside_share(layout, where, axes, gpus_per_node) if group in EVEN_ALL_TO_ALL else (0, 1)
        inside += sent * near // peers
        across += sent - sent * near // peers
    return inside, across


class ExpertNodes(NamedTuple):
    """Where the experts of one MoE layer lie for the rank at `where` (its ep group): the nodes its ep group
    spans, the share of its dispatch's peers on its own node, and for group-limited routing (n_group,
    topk_group) the most nodes one group's experts lie on and the most a token's top_k experts can reach."""
    nodes: int
    near: int
    peers: int
    group_nodes: int
    token_nodes: int


def expert_nodes(config, layout, where, gpus_per_node):
    """ExpertNodes of the rank at `where`: ep rank k holds experts [k E/ep, (k+1) E/ep) (ep.py) and group g of
    DeepSeek-V3's routing the experts [g E/n_group, (g+1) E/n_group) (model.best_groups_only), so a group's
    experts lie on the nodes of the ep ranks holding them. A token's top_k experts lie in at most topk_group
    groups: at most the topk_group groups spanning most nodes, and never more than top_k nodes."""
    members = group_members(layout, where, ("ep",))
    node_of_ep_rank = [rank // gpus_per_node for rank in members]
    per_rank, per_group = config.n_experts // layout.ep, config.n_experts // config.n_group
    nodes_of_group = [len({node_of_ep_rank[expert // per_rank] for expert in range(g * per_group, (g + 1) * per_group)})
                      for g in range(config.n_group)]
    widest = sorted(nodes_of_group, reverse=True)[:config.topk_group]
    nodes = len(set(node_of_ep_rank))
    near, peers = inside_share(layout, where, ("ep",), gpus_per_node)
    return ExpertNodes(nodes, near, peers, max(nodes_of_group), min(config.top_k, nodes, sum(widest)))
