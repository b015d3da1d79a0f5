"""Muon (training/muon.py): Newton-Schulz against the SVD's polar factor, the optimizer against the algorithm
written out, the pieces each layout holds against the matrices they come from, and the owners' balance.
Every layout's run equals the single device's in float64 in test_compose (the Llama twins), test_fold,
test_zero_pipeline (hybrid ZeRO-3, ZB-V, a checkpoint resumed under another sharding); here the assembly by
every holder, and a checkpoint under another optimizer refused."""
import math
from types import SimpleNamespace

import pytest
import torch

import tp
import train
from model import GPT, GPTConfig
from training import cli, muon
from distributed import run_on_ranks
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan


def polar_parts(matrix):
    """(P, singular values, Q^T) of matrix = P S Q^T, the thin SVD."""
    return torch.linalg.svd(matrix, full_matrices=False)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (16, 96), (96, 24)])
def test_newton_schulz_is_the_polar_factor_with_its_published_spread(shape):
    """NewtonSchulz5(G) = P f(S) Q^T for G = P S Q^T: the polar factor P Q^T with each singular value moved into
    Jordan's published range, "roughly Uniform(0.5, 1.5)" (here 0.68 to 1.18), for a Gaussian matrix whose
    smallest singular value is over 4% of its Frobenius norm (smaller ones grow by about 3.4 a step, and
    five steps leave one under 1e-3 of the norm small: Muon's known limit, not tested)."""
    generator = torch.Generator().manual_seed(sum(shape))
    for _ in range(3):
        g = torch.randn(shape, dtype=torch.float64, generator=generator)
        p, s, qt = polar_parts(g)
        assert s.min() > 0.04 * g.norm()
        x = muon.newton_schulz(g, dtype=torch.float64)
        in_polar_basis = p.mT @ x @ qt.mT
        spread = in_polar_basis.diagonal()
        torch.testing.assert_close(in_polar_basis, torch.diag(spread), rtol=0, atol=1e-12)
        assert 0.5 < spread.min() and spread.max() < 1.5, spread
        # in bfloat16 (as a run with bfloat16 weights computes it): the same spread, and the polar basis to
        # bfloat16's rounding (2^-8) grown over five steps (measured at most 0.027 off the diagonal)
        rounded = p.mT @ muon.newton_schulz(g, dtype=torch.bfloat16).double() @ qt.mT
        assert 0.5 < rounded.diagonal().min() and rounded.diagonal().max() < 1.5
        assert (rounded - torch.diag(rounded.diagonal())).abs().max() < 0.04


def written_out_newton_schulz(u):
    a, b, c = 3.4445, -4.7750, 2.0315  # Jordan et al., 2024
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        x = a * x + b * (x @ x.T) @ x + c * (x @ x.T) @ (x @ x.T) @ x
    return x.T if u.shape[0] > u.shape[1] else x


def written_out_matrices(name, p, config):
    """The logical matrices Muon takes of parameter `name`, as row ranges, or None (AdamW's)."""
    if not name.startswith("blocks.") or p.dim() != 2 or "router" in name:
        return None
    if name.endswith("qkv.weight"):
        q, kv = config.n_head * config.head_dim, config.n_kv_heads * config.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    if name.endswith("fc.weight"):  # SwiGLU: gate | up
        return [(0, len(p) // 2), (len(p) // 2, len(p))]
    return [(0, len(p))]


def test_single_device_muon_is_the_algorithm_written_out():
    """Moonlight's Algorithm 1 on each logical matrix (Nesterov momentum 0.95, five quintic Newton-Schulz
    steps, 0.2 sqrt(max(rows, cols)), decoupled decay), AdamW on the rest; a matrix without a gradient
    (an expert no token reached) is left alone, its momentum too, as torch's optimizers leave it."""
    config = GPTConfig(**{**cli.PRESETS["tiny"], **cli.LLAMA, "n_kv_heads": 2, "d_ff": 48, "n_experts": 4,
                          "top_k": 2, "n_shared_experts": 1})
    model, reference = (train.build_model(config, 0, torch.float64, torch.device("cpu")) for _ in range(2))
    lr, decay = 0.02, 0.1
    adamw_of = lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=decay)  # noqa: E731
    optimizer = muon.single_device(model, adamw_of, lr, decay, torch.float64)
    named = dict(reference.named_parameters())
    matrices = {name: written_out_matrices(name, p, config) for name, p in named.items()}
    adamw = adamw_of([p for name, p in named.items() if not matrices[name]])
    momentum = {name: torch.zeros_like(p) for name, p in named.items() if matrices[name]}
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        idle = "blocks.1.mlp.experts.3." if step == 1 else "none"
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            p.grad = None if idle in name else torch.randn(p.shape, dtype=p.dtype, generator=generator)
            q.grad = None if p.grad is None else p.grad.clone()
        optimizer.step()
        adamw.step()
        with torch.no_grad():
            for name, p in named.items():
                if matrices[name] and p.grad is not None:
                    momentum[name] = 0.95 * momentum[name] + p.grad
                    u = p.grad + 0.95 * momentum[name]
                    p.mul_(1 - lr * decay)
                    for lo, hi in matrices[name]:
                        rows = p[lo:hi]
                        rows -= lr * 0.2 * math.sqrt(max(rows.shape)) * written_out_newton_schulz(u[lo:hi])
    assert sum(bool(m) for m in matrices.values()) == 2 * (2 + 5 * 2)  # per block: qkv, proj; 5 MLPs' fc, proj
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-13, msg=name)


@pytest.mark.parametrize("dim,blocks", [(0, [8, 4, 4]), (0, None), (1, None)])
@pytest.mark.parametrize("parts", [1, 2])
def test_each_layouts_pieces_put_every_element_back_where_it_came_from(dim, blocks, parts):
    """A 16 x 6 parameter (q | k | v fused, a column-parallel or a row-parallel layer) cut by tensor parallelism
    (tp.shard), each part then cut by ZeRO into pieces at arbitrary places: the Segments of all the pieces put
    each element into its logical matrix at its place, and cover every matrix once."""
    config = SimpleNamespace(q_dim=8, kv_dim=4, mlp="gelu")
    name = "blocks.0.attn.qkv.weight" if blocks else "blocks.0.attn.proj.weight"
    full = torch.arange(96, dtype=torch.float64).view(16, 6)
    rows = muon.matrix_rows(name, full.shape, config)
    matrices = dict(zip([f"{name}[{i}]" for i in range(3)] if blocks else [name], full.split(rows)))
    rebuilt = {key: torch.full_like(m, -1) for key, m in matrices.items()}
    for part in range(parts):
        local = tp.shard(full, dim, part, parts, blocks).reshape(-1)
        cuts = [0, 5, 17, local.numel() // 2 + 1, local.numel()]  # ZeRO's shard boundaries fall anywhere
        for start, end in zip(cuts, cuts[1:]):
            split = (dim, parts, part) if parts > 1 else None
            shape = (16 // parts, 6) if dim == 0 else (16, 6 // parts)
            for s in muon.segments(name, shape, rows, split, start, end):
                assert s.shape == tuple(matrices[s.key].shape)
                values = local[start + s.start:start + s.start + s.numel]
                muon._copy_into(s.views(rebuilt[s.key]), values)
    for key, matrix in matrices.items():
        torch.testing.assert_close(rebuilt[key], matrix, rtol=0, atol=0, msg=key)


def even_holdings(n_ranks, sizes):
    """Each matrix (rows x 12) split into n_ranks equal row bands, one per rank."""
    held = {rank: [] for rank in range(n_ranks)}
    for i, rows in enumerate(sizes):
        band = rows * 12 // n_ranks
        for rank in range(n_ranks):
            held[rank].append(muon.Segment(f"m{i}", 0, (rows, 12), (0, 0), (rows, 12), rank * band,
                                           (rank + 1) * band))
    return held


def test_owners_are_holders_balanced_by_size_and_traffic_is_as_the_docstring_says():
    """Longest-first to the least loaded: loads within the largest matrix of each other. Evenly split over
    N = 4 ranks, one owner each sends 2 (N-1)/N of each matrix in all (its pieces there, O's back), every
    holder gathering N (N-1)/N: N/2 times more."""
    sizes = [48, 40, 32, 32, 24, 16, 8, 8]
    held = even_holdings(4, sizes)
    owners = muon.assign_owners(held)
    load = [sum(rows * 12 for i, rows in enumerate(sizes) if owners[0, f"m{i}"] == [rank]) for rank in range(4)]
    assert all(len(o) == 1 for o in owners.values())
    assert max(load) - min(load) <= max(sizes) * 12 and sum(load) == sum(sizes) * 12
    elements = sum(sizes) * 12
    one_owner = sum(muon.bytes_sent(held, owners, 2).values())
    everyone = sum(muon.bytes_sent(held, muon.assign_owners(held, every_holder=True), 2).values())
    assert one_owner == 2 * elements * 3 // 4 * 2
    assert everyone == 4 * elements * 3 // 4 * 2 == 2 * one_owner


def test_a_whole_matrix_on_one_rank_stays_there():
    """A matrix one rank holds whole (a small one ZeRO did not cut, an expert of its own) is its own: no bytes."""
    held = {0: [muon.Segment("a", 0, (4, 4), (0, 0), (4, 4), 0, 16)], 1: [muon.Segment("b", 0, (4, 4), (0, 0),
                                                                                        (4, 4), 0, 16)]}
    owners = muon.assign_owners(held)
    assert owners == {(0, "a"): [0], (0, "b"): [1]} and not any(muon.bytes_sent(held, owners, 8).values())


def test_a_checkpoint_resumes_only_under_its_own_optimizer():
    saved = SimpleNamespace(path="runs/x/checkpoint-00000002", manifest=dict(args=dict(optimizer="adamw")))
    args = cli.parse_args(["--optimizer", "muon"])
    with pytest.raises(cli.ConfigError, match="its optimizer state is adamw's; resume it with --optimizer adamw"):
        train.same_optimizer(saved, args)
    train.same_optimizer(saved, cli.parse_args([]))
    older = SimpleNamespace(path=saved.path, manifest=dict(args={}))  # written before --optimizer: AdamW's
    train.same_optimizer(older, cli.parse_args(["--optimizer", "adamw"]))


def test_an_assembly_without_muon_is_refused():
    with pytest.raises(cli.ConfigError, match="--muon-assembly gather is how Muon assembles its matrices: it needs "
                                              "--optimizer muon"):
        cli.check_args(cli.parse_args(["--muon-assembly", "gather"]), 1)


def test_every_holder_assembling_equals_one_device_and_the_plan(tmp_path):
    """--muon-assembly gather: each rank of ZeRO-1 x tp 2 orthogonalises every matrix it holds a piece of."""
    model = ["--arch", "llama", "--optimizer", "muon"]
    argv = [*EQUIVALENCE, *model, "--zero", "1", "--tp", "2", "--muon-assembly", "gather"]
    for result in run_on_ranks(4, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*EQUIVALENCE, *model]))
    assert_matches_plan(tmp_path, argv, 4)


def test_a_model_built_whole_has_its_matrices_found(tmp_path):
    """Which weights take Muon in the tiny Llama: 2 blocks x (q, k, v, proj, gate, up, proj); none else."""
    config = GPTConfig(**{**cli.PRESETS["tiny"], **cli.LLAMA, "n_kv_heads": 2, "d_ff": 48})
    with torch.device("meta"):
        model = GPT(config)
    keys = {s.key for _, found in muon.held_segments([(n, 0, p.numel(), p) for n, p in model.named_parameters()],
                                                      {n: p.shape for n, p in model.named_parameters()}, config)
            for s in found}
    assert keys == {f"blocks.{i}.{m}" for i in range(2) for m in
                    ("attn.qkv.weight[0]", "attn.qkv.weight[1]", "attn.qkv.weight[2]", "attn.proj.weight",
                     "mlp.fc.weight[0]", "mlp.fc.weight[1]", "mlp.proj.weight")}
