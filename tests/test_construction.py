"""Sharded construction, and sharded checkpoints: each rank allocates and fills only its share of the model
(which equals the same elements of the single device's initial weights, exactly), saves only its share and
reads back only the elements it holds."""
import math
from collections import Counter
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from training import checkpoint
from training import cli
import train
from distributed import run_on_ranks
from dp import ZeRO3, is_allocated
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


def held_shapes(trainer):
    """Shapes this rank may write: those of the parameters it holds (ZeRO-3 gathers them, a unit at a time),
    and flat (a whole parameter's shape can be another's slice, or as long as another's flat values: those
    are left out of the watch), and its optimizer's pieces."""
    held = {shape for p in trainer.params for shape in (tuple(p.shape), (p.numel(),))}
    return held | {(end - start,) for optimizer in trainer.optimizers for _, start, end, _ in optimizer.pieces()}


def held_elements(trainer):
    """The elements of the parameters this rank holds: allocated ones, and ZeRO-3's pieces of the others."""
    pieces = sum(end - start for zero in trainer.optimizers if isinstance(zero, ZeRO3)
                 for _, start, end, _ in zero.pieces())
    return sum(p.numel() for p in trainer.params if is_allocated(p)) + pieces


def outside(watch, trainer, full_shapes):
    """What the watch saw written, or left holding memory, that trainer's rank does not hold in that shape.
    Written tensors count if they have the full shape of a parameter tensor parallelism cuts (whatever the
    pipeline and the experts place, and ZeRO-3 shards, is whole where it is, so its shape tells nothing: the
    counts of elements drawn and read watch those)."""
    held = held_shapes(trainer)
    cut = {full_shapes[name] for name in trainer.tp_layouts}
    return dict(written=[w for w in watch.written if w[1] in cut - held],
                placeholders_left=[tuple(t.shape) for t in watch.placeholders
                                   if is_allocated(t) and tuple(t.shape) not in held])


def construct(argv, folder):
    """Build train.py's Trainer on this rank, take a step, save a checkpoint, and build it again from the
    checkpoint, each under the watch; returns what each wrote outside this rank's share, the elements it
    drew or read, and its model gathered to the single device's layout beside the single device's."""
    args = cli.parse_args(argv)
    config, shape = cli.check_args(args, dist.get_world_size())
    mesh = Mesh(shape)
    data = train.load_training_data(args)
    reference = train.build_model(config, args.seed, torch.float64, torch.device("cpu"))
    full_shapes = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    watch = partial(WrittenTensors, set(full_shapes.values()))
    drawn, read = Counter(), Counter()

    class Recorded(train.InitialValues):
        def parameter(self, name, positions):
            drawn[name] += positions.numel()
            return super().parameter(name, positions)

    class RecordedCheckpoint(checkpoint.Checkpoint):
        def read(self, name, key, positions):
            read[key] += positions.numel() if name in full_shapes else 0  # (buffers are small, whole everywhere)
            return super().read(name, key, positions)

    train.InitialValues, checkpoint.Checkpoint = Recorded, RecordedCheckpoint
    with watch() as built:
        trainer = train.Trainer(args, config, mesh, data, torch.device("cpu"))
    initial_state = trainer.state.full_state_dict()
    saver = checkpoint.Saver(dist.new_group(backend="gloo"))
    with watch() as stepped:
        trainer.train_step(0)
        trainer.save_checkpoint(saver, folder, 1, keep=1)
        saver.wait()
    args.resume = folder
    with watch() as loaded:
        resumed = train.Trainer(args, config, mesh, data, torch.device("cpu"))
    optimizer_elements = sum(end - start for optimizer in resumed.optimizers
                             for _, start, end, _ in optimizer.pieces())
    return dict(built=outside(built, trainer, full_shapes), stepped=outside(stepped, trainer, full_shapes),
                loaded=outside(loaded, resumed, full_shapes),
                drawn=sum(drawn.values()), held=held_elements(trainer), read_weights=read.pop("model"),
                read_moments=dict(read), optimizer_elements=optimizer_elements,
                names=set(drawn) <= set(dict(trainer.model.named_parameters())),
                state_dict=initial_state, reference=reference.state_dict(),
                saved=trainer.state.full_state_dict(), resumed=resumed.state.full_state_dict())


@pytest.mark.skipif(TorchDispatchMode is None, reason="torch.utils._python_dispatch is gone from this PyTorch")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_builds_saves_and_loads_only_its_share_and_it_equals_the_single_device(layout, tmp_path):
    world, flags = LAYOUTS[layout]
    # One token a sequence: no activation, however the experts' routing goes, has a cut parameter's shape.
    argv = [*EQUIVALENCE, "--layers", "4", "--seq-len", "1", *flags]
    for rank, result in enumerate(run_on_ranks(world, construct, argv, str(tmp_path / "checkpoint-00000001"))):
        for when in ("built", "stepped", "loaded"):
            written = sorted(set(result[when]["written"]))
            assert written == [], f"rank {rank} wrote whole parameters it does not hold ({when}): {written}"
            assert result[when]["placeholders_left"] == [], f"rank {rank} kept memory it was to free ({when})"
        assert result["drawn"] == result["held"], f"rank {rank} drew other values than the elements it holds"
        assert result["read_weights"] == result["held"], f"rank {rank} read other weights than those it holds"
        assert result["read_moments"] == dict(exp_avg=result["optimizer_elements"],
                                              exp_avg_sq=result["optimizer_elements"])
        assert result["names"]
        assert result["state_dict"].keys() == result["reference"].keys()
        for name, expected in result["reference"].items():
            assert torch.equal(result["state_dict"][name], expected), (rank, name)
        for name, expected in result["saved"].items():
            assert torch.equal(result["resumed"][name], expected), (rank, name)
    # Every element of every tensor saved once: the pieces of each tensor's weights and moments tile it.
    manifest = checkpoint.Checkpoint(tmp_path / "checkpoint-00000001").manifest
    elements = Counter()
    for piece in manifest["pieces"]:
        elements[piece["name"], piece["key"]] += piece["end"] - piece["start"]
    for (name, key), count in elements.items():
        assert count == math.prod(manifest["tensors"][name]["shape"]), (name, key)


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
