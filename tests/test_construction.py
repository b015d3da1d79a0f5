"""Sharded construction: each rank allocates and fills only its share of the model, and that share equals
the same elements of the single device's initial weights, exactly."""
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

import cli
import train
from distributed import run_on_ranks
from dp import is_allocated
from mesh import Mesh
from model import GPT, GPTConfig, initial_values
from oracle import EQUIVALENCE

try:  # an internal API (present from 2.0 to today's releases): the watch below needs every operator
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover
    TorchDispatchMode = None

LAYOUTS = {
    "tp2": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "ep2": (2, ["--experts", "4", "--ep", "2"]),
    "zero3-dp4": (4, ["--zero", "3"]),
    "tp2-pp2-ep2-zero1": (8, ["--tp", "2", "--pp", "2", "--experts", "4", "--ep", "2", "--zero", "1"]),
    "llama-tp2-ep2-zero3": (4, ["--arch", "llama", "--tp", "2", "--experts", "4", "--ep", "2", "--zero", "3"]),
}


class WrittenTensors(TorchDispatchMode):
    """Every floating-point tensor an operator writes on a real device whose shape is one of `shapes`:
    torch.empty's (placeholders, never written, kept to check they were freed) apart from the others."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.written, self.placeholders = shapes, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a new view of memory that exists already: nothing written
            return out
        for t in tree_flatten(out)[0]:
            watched = isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta
            if watched and tuple(t.shape) in self.shapes:
                if func is torch.ops.aten.empty.memory_format:
                    self.placeholders.append(t)
                else:
                    self.written.append((str(func), tuple(t.shape)))
        return out


def construct(argv):
    """Build train.py's Trainer on this rank under the watch; returns what it wrote, what it drew, and
    its model gathered to the single device's layout beside the single device's."""
    args = cli.parse_args(argv)
    mesh = Mesh(cli.check_args(args, dist.get_world_size()))
    data = train.load_training_data(args)
    config = cli.model_config(args, data.vocab_size)
    reference = train.build_model(config, args.seed, torch.float64, torch.device("cpu"))
    full_shapes = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    drawn = Counter()

    class Recorded(train.InitialValues):
        def parameter(self, name, positions):
            drawn[name] += positions.numel()
            return super().parameter(name, positions)

    train.InitialValues = Recorded
    with WrittenTensors(set(full_shapes.values())) as watch:
        trainer = train.Trainer(args, mesh, data, torch.device("cpu"))
    # Shapes this rank may write: those of the parameters it holds, and flat (a whole parameter's shape
    # can be another's slice, or as long as another's flat values: those are left out of the watch).
    held = {shape for p in trainer.params if is_allocated(p) for shape in (tuple(p.shape), (p.numel(),))}
    pieces = [hi - lo for zero in trainer.optimizers if getattr(zero, "own_copy", False)  # ZeRO-3's
              for shard in zero.shards.values() for lo, hi in shard.ranges.values()]
    held |= {(n,) for n in pieces}  # a piece can be a whole (one-dimensional) parameter
    elements = sum(p.numel() for p in trainer.params if is_allocated(p)) + sum(pieces)
    return dict(written=[w for w in watch.written if w[1] not in held],
                placeholders_left=[tuple(t.shape) for t in watch.placeholders
                                   if is_allocated(t) and tuple(t.shape) not in held],
                drawn=sum(drawn.values()), held=elements,
                names=set(drawn) <= set(dict(trainer.model.named_parameters())),
                state_dict=trainer.full_state_dict(), reference=reference.state_dict())


@pytest.mark.skipif(TorchDispatchMode is None, reason="torch.utils._python_dispatch is gone from this PyTorch")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_builds_only_its_share_and_it_equals_the_single_device(layout):
    world, flags = LAYOUTS[layout]
    for rank, result in enumerate(run_on_ranks(world, construct, [*EQUIVALENCE, "--layers", "4", *flags])):
        assert result["written"] == [], f"rank {rank} wrote whole parameters it does not hold whole"
        assert result["placeholders_left"] == [], f"rank {rank} kept memory it was to free"
        assert result["drawn"] == result["held"], f"rank {rank} drew other values than the elements it holds"
        assert result["names"]
        assert result["state_dict"].keys() == result["reference"].keys()
        for name, expected in result["reference"].items():
            assert torch.equal(result["state_dict"][name], expected), (rank, name)


def test_initial_values_of_a_slice_equal_those_of_the_whole():
    """The counter-based draw: any positions, in any order, alone or together, give the same values;
    different names and seeds give different ones; the statistics are GPT-2's."""
    positions = torch.arange(100_000)
    whole = initial_values("blocks.0.attn.qkv.weight", positions, n_layer=4, seed=0)
    picked = torch.tensor([99_999, 3, 50_000, 2**40 + 7])
    alone = initial_values("blocks.0.attn.qkv.weight", picked, n_layer=4, seed=0)
    assert torch.equal(alone[:3], whole[picked[:3]])
    assert alone[3] != whole[7]  # a position beyond 2**32 is its own, not a wrapped one
    assert not torch.equal(whole, initial_values("blocks.1.attn.qkv.weight", positions, n_layer=4, seed=0))
    assert not torch.equal(whole, initial_values("blocks.0.attn.qkv.weight", positions, n_layer=4, seed=1))
    # N(0, 0.02): mean and standard deviation within a few standard errors of 100,000 draws.
    assert abs(whole.mean()) < 4 * 0.02 / 100_000**0.5
    assert abs(whole.std() - 0.02) < 4 * 0.02 / (2 * 100_000)**0.5
    proj = initial_values("blocks.0.mlp.proj.weight", positions, n_layer=4, seed=0)
    assert abs(proj.std() - 0.02 / 8**0.5) < 4 * 0.02 / 8**0.5 / (2 * 100_000)**0.5
    assert torch.equal(initial_values("norm.weight", picked, 4, 0), torch.ones(4, dtype=torch.float64))
    assert torch.equal(initial_values("blocks.0.attn.qkv.bias", picked, 4, 0), torch.zeros(4, dtype=torch.float64))


def test_the_model_built_in_place_equals_the_model_built_on_meta():
    """GPT(config, seed) fills itself with the same values train.build_model gives a meta-built model."""
    config = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=64, n_experts=4)
    built = train.build_model(config, 3, torch.float32, torch.device("cpu"))
    direct = GPT(config, seed=3)
    for (name, a), (_, b) in zip(built.state_dict().items(), direct.state_dict().items()):
        assert torch.equal(a, b), name
