"""On a GPU: the same code on CUDA and NCCL; skipped, with the reason, where there is none.

These are one-rank checks: the GPU machines this project can borrow have one GPU, and NCCL refuses
two ranks on one GPU, so multi-rank NCCL runs cannot be made there (the CPU tests prove every
layout under NCCL's matching rule instead, see distributed.py).
"""
import json
import subprocess
import sys

import pytest
import torch

from training.checkpoint import Checkpoint
from distributed import REPO, run_on_ranks, self_check_alone, torchrun
from oracle import EQUIVALENCE, assert_matches_oracle, oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: GPU checks need one")


def read_run(run_dir):
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "config.json").read_text()), log


def assert_cuda_run_matches_oracle(run, argv):
    """A one-GPU run's losses and final weights against the CPU oracle of the same flags. CUDA's kernels sum in
    another order than the CPU's: float64 agrees to that order's rounding."""
    config, log = read_run(run)
    assert config["device"].startswith("cuda")
    state_dict = Checkpoint(run / "checkpoint-00000003").model_state()
    assert_matches_oracle(dict(losses=[e["loss"] for e in log], state_dict=state_dict), oracle(argv))


def test_one_rank_on_cuda_in_float64_equals_the_cpu_oracle(tmp_path):
    out = torchrun(1, "train.py", *EQUIVALENCE, "--out", str(tmp_path))  # NCCL, world 1
    assert out.returncode == 0, out.stderr
    assert_cuda_run_matches_oracle(tmp_path / "gpu1_tp1_pp1_cp1_ep1", EQUIVALENCE)


def test_bfloat16_training_runs_and_its_loss_falls(tmp_path):
    out = torchrun(1, "train.py", "--model", "small", "--dtype", "bfloat16", "--steps", "40", "--lr", "1e-2",
                   "--eval-interval", "1000", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    config, log = read_run(tmp_path / "gpu1_tp1_pp1_cp1_ep1")
    losses = [e["loss"] for e in log]
    floor = config["entropy_floor"]
    # From about ln(256) = 5.5 towards the floor (1.09): at least half the way in 40 steps.
    assert losses[-1] - floor < 0.5 * (losses[0] - floor)
    if "mfu" in log[-1]:  # a GPU of the table (training/mfu.py's PEAK_TFLOPS)
        assert 0 < log[-1]["mfu"] < 1


@pytest.mark.parametrize("filename", ["dp.py", "tp.py", "pp.py", "cp.py", "ep.py"])
def test_every_self_check_runs_on_one_gpu_with_nccl(tmp_path, filename):
    differences = self_check_alone(filename, 1, tmp_path)
    assert differences and max(differences) < 1e-12


def test_initial_values_drawn_on_cuda_equal_the_cpu_ones():
    """The draw by position on the GPU where a rank fills its share, against the CPU's (the oracle's): the
    hash is integer arithmetic, exact on both; the normal's inverse distribution function is each device's
    own float64 kernel, so they agree to float64's last bits."""
    from model import initial_values
    positions = torch.arange(2**40 - 50_000, 2**40 + 50_000)
    cpu = initial_values("blocks.3.mlp.fc.weight", positions, n_layer=4, seed=7)
    cuda = initial_values("blocks.3.mlp.fc.weight", positions.cuda(), n_layer=4, seed=7)
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-14, atol=0)


def test_cuda_kernels_chosen_by_dtype_and_head_size():
    import cp
    cuda = torch.device("cuda")
    assert cp.default_kernels(cuda, torch.bfloat16, 64) is cp.CUDA_FLASH  # on Ampere or later, as all here
    assert cp.default_kernels(cuda, torch.float16, 64) is cp.CUDA_FLASH
    assert cp.default_kernels(cuda, torch.float32, 64) is cp.CUDA_EFFICIENT
    assert cp.default_kernels(cuda, torch.bfloat16, 512) is cp.CUDA_EFFICIENT  # heads over flash's 256
    assert cp.default_kernels(cuda, torch.float64, 64) is cp.EXPLICIT  # no fused CUDA kernel in float64
    assert cp.default_kernels(cuda, torch.bfloat16, 12) is cp.EXPLICIT  # not a multiple of 8
    assert cp.default_kernels(cuda, torch.bfloat16, 192, 128) is cp.CUDA_EFFICIENT  # latent attention's widths


def ring_kernels_on_cuda(kernels_name, dtype_name, seq_len, v_head_dim=64, seen=None):
    """Ring attention on a ring of one rank (so every kind of block runs: causal and not, merged) with
    fused CUDA kernels and with the written-out blocks, forward and backward: the dtypes returned, and
    each result's largest difference relative to the largest reference value. v_head_dim: the values'
    width (the queries' and keys' is 64). seen "documents": within documents of about 37 tokens, a window
    of 50 and with sinks (their gradient last), by the one-device core (tiles of 32 queries, masked and
    not); "window": the window alone (its masks made on the queries' device), with sinks."""
    import cp
    device, dtype, fused = torch.device("cuda"), getattr(torch, dtype_name), getattr(cp, kernels_name)
    g = torch.Generator(device=device).manual_seed(0)
    q, grad = (torch.randn(2, 8, seq_len, 64, device=device, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, seq_len, width, device=device, generator=g).to(dtype)  # GQA
            for width in (64, v_head_dim))
    grad = grad[..., :v_head_dim]
    sinks = torch.randn(8, device=device, generator=g) if seen else None
    documents = torch.arange(seq_len, device=device).div(37, rounding_mode="floor").expand(2, -1)
    options = dict(documents=documents if seen == "documents" else None, window=50) if seen else {}
    cp.VisibleMasks.tile = 32
    results = {}
    for kernels in (fused, cp.EXPLICIT):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, *([sinks] if seen else []))]
        if seen:
            out, lse = cp.one_device_attention(*leaves[:3], kernels=kernels, sinks=leaves[3], **options)
        else:
            out, lse = cp.ring_attention(*leaves, None, kernels=kernels)
        out.backward(grad)
        results[kernels] = [out, lse, *(t.grad for t in leaves)]
    differences = [((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
                   for a, b in zip(results[fused], results[cp.EXPLICIT])]
    return dict(dtypes=[str(t.dtype) for t in results[fused]], differences=differences)


@pytest.mark.parametrize("seq_len", [74, 256], ids=["chunks-of-37", "chunks-of-128"])  # 37: padded lse rows
@pytest.mark.parametrize("kernels,dtype,tolerance", [("CUDA_FLASH", "bfloat16", 4 * 2**-8),
                                                     ("CUDA_EFFICIENT", "float32", 1e-4),
                                                     ("CUDA_EFFICIENT", "bfloat16", 4 * 2**-8)])
def test_ring_attention_with_the_cuda_kernels_equals_the_written_out_blocks(kernels, dtype, tolerance, seq_len):
    """bfloat16: the reference computes in float32 from the same inputs, the kernels round their
    probabilities before P·V and each block's output to bfloat16 (2^-8 relative each), so they differ
    by a few such roundings. float32: float32 rounding in another order. The log-sum-exps, float32 sums
    of the same scores in both, agree ten times closer (measured on CPUs with the fused CPU kernel in
    bfloat16: 1e-5)."""
    result, = run_on_ranks(1, ring_kernels_on_cuda, kernels, dtype, seq_len)
    assert result["dtypes"] == [f"torch.{dtype}", "torch.float32"] + [f"torch.{dtype}"] * 3
    out, lse, *grads = result["differences"]
    assert lse < tolerance / 10
    assert max(out, *grads) < tolerance


@pytest.mark.parametrize("seen", ["documents", "window"])
@pytest.mark.parametrize("kernels,dtype,tolerance", [("CUDA_FLASH", "bfloat16", 4 * 2**-8),
                                                     ("CUDA_EFFICIENT", "float32", 1e-4)])
def test_the_one_device_core_within_documents_windows_and_sinks_on_cuda(kernels, dtype, tolerance, seen):
    """The tiles a query sees (masked ones on the memory-efficient kernel, the others on FlashAttention where
    the dtype has it) and the sinks, against the written-out blocks, forward and backward (tolerance as
    above; the sinks' gradient is a float32 sum over every row of terms the kernels rounded alike)."""
    result, = run_on_ranks(1, ring_kernels_on_cuda, kernels, dtype, 256, 64, seen)
    assert result["dtypes"] == [f"torch.{dtype}", "torch.float32"] + [f"torch.{dtype}"] * 3 + ["torch.float32"]
    out, lse, *grads = result["differences"]
    assert lse < tolerance / 10 and max(out, *grads) < tolerance


def flex_on_cuda(dtype_name, seq_len, seen):
    """training/flex.py's core (compiled FlexAttention over its block mask, sinks merged) against cp.py's
    one-device core on the written-out blocks, forward and backward: each result's largest difference relative
    to the largest reference value. seen as in ring_kernels_on_cuda, over seq_len tokens."""
    import cp
    from training.flex import FlexAttentionCore, flex_applies
    device, dtype = torch.device("cuda"), getattr(torch, dtype_name)
    g = torch.Generator(device=device).manual_seed(0)
    q, grad = (torch.randn(2, 8, seq_len, 64, device=device, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, seq_len, 64, device=device, generator=g).to(dtype) for _ in range(2))  # GQA
    sinks = torch.randn(8, device=device, generator=g)
    documents = torch.arange(seq_len, device=device).div(37, rounding_mode="floor").expand(2, -1)
    options = dict(documents=documents if seen == "documents" else None, window=50)
    assert flex_applies(q, v, options["documents"], options["window"])
    results = []
    for attention in (FlexAttentionCore(),
                      lambda *t, **o: cp.one_device_attention(*t, kernels=cp.EXPLICIT, **o)[0]):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = attention(*leaves[:3], sinks=leaves[3], **options)
        out.backward(grad)
        results.append([out, *(t.grad for t in leaves)])
    return [((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in zip(*results)]


@pytest.mark.parametrize("seen", ["documents", "window"])
@pytest.mark.parametrize("seq_len", [300, 1024])  # blocks of 128 and a part one; eight whole ones
@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 4 * 2**-8), ("float32", 1e-4)])
def test_flexattention_core_equals_the_written_out_blocks_on_cuda(dtype, tolerance, seq_len, seen):
    """The core train.py installs on one GPU, where FlexAttention takes documents and windows: output, dQ, dK, dV
    and the sinks' gradient (through FlexAttention's log-sum-exp) against the written-out blocks (tolerance as
    above: the kernel rounds its probabilities and output to the inputs' dtype, the reference does not)."""
    result, = run_on_ranks(1, flex_on_cuda, dtype, seq_len, seen)
    assert max(result) < tolerance


def fp8_operands():
    """x, W and dY in bfloat16 (shapes the CUDA kernels must pad: 40 input features, 24 output, 5 tokens)."""
    g = torch.Generator().manual_seed(0)
    x, weight, grad = (torch.randn(*shape, generator=g) for shape in ((5, 40), (24, 40), (5, 24)))
    x[1] = 0
    x[2, 0] = 1e4  # past e4m3's range before scaling
    return [t.to(torch.bfloat16) for t in (x, weight, grad)]


def fp8_products_on(device_name, recipe):
    """training/fp8.py's float8 linear in bfloat16 on `device_name`: (y, dX, dW) as float64 on the CPU."""
    from training import fp8
    x, weight, grad = fp8_operands()
    leaves = [t.to(device_name, torch.bfloat16).requires_grad_() for t in (x, weight)]
    y = fp8.float8_linear(*leaves, None, fp8.RECIPES[recipe], fp8.Split())
    y.backward(grad.to(device_name, torch.bfloat16))
    return [t.double().cpu() for t in (y, leaves[0].grad, leaves[1].grad)]


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_products_on_cuda_equal_the_reference_written_out(recipe):
    """torch._scaled_mm on the GPU against the products written out in float64 (tests/test_fp8.py's reference:
    each operand through float8 and back by the recipe's scales), from the same bfloat16 inputs: the GPU sums
    exact products in float32 and rounds to bfloat16, so they agree to about one bfloat16 rounding of the
    largest value (2^-8), held to two (2^-7). No other device's kernel is the reference."""
    from test_fp8 import reference
    inputs = [t.double() for t in fp8_operands()]  # what the GPU's products start from
    for cuda, want in zip(fp8_products_on("cuda", recipe), reference(recipe, *inputs)):
        assert (cuda - want).abs().max() <= 2**-7 * want.abs().max()


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_training_on_one_gpu_runs_and_its_loss_falls(tmp_path, recipe):
    out = torchrun(1, "train.py", "--model", "small", "--dtype", "bfloat16", "--fp8", recipe, "--steps", "40",
                   "--lr", "1e-2", "--eval-interval", "1000", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    config, log = read_run(tmp_path / "gpu1_tp1_pp1_cp1_ep1")
    losses, floor = [e["loss"] for e in log], config["entropy_floor"]
    assert config["args"]["fp8"] == recipe and losses[-1] - floor < 0.5 * (losses[0] - floor)  # as bfloat16's, above


def test_ring_attention_with_values_of_their_own_width_on_cuda():
    """Latent attention's values are narrower than its keys (DeepSeek-V3: 128 against 192): the memory-efficient
    kernel takes them, and equals the written-out blocks as with one width (tolerance as above)."""
    result, = run_on_ranks(1, ring_kernels_on_cuda, "CUDA_EFFICIENT", "bfloat16", 256, 32)
    out, lse, *grads = result["differences"]
    assert lse < 4 * 2**-8 / 10 and max(out, *grads) < 4 * 2**-8


def test_a_deterministic_run_repeats_bit_for_bit_on_a_gpu(tmp_path):
    """--deterministic (training/determinism.py): the same bfloat16 run of the llama block with packed documents
    and experts (index_add_, the fused attention's backward), twice, compared by tools.compare --assert-equal,
    every setting recorded in config.json."""
    argv = ["--model", "small", "--arch", "llama", "--dtype", "bfloat16", "--steps", "6", "--experts", "4",
            "--document-mask", "--eos-id", "0", "--deterministic", "--checkpoint-interval", "3",
            "--eval-interval", "1000"]
    for name in ("a", "b"):
        out = torchrun(1, "train.py", *argv, "--out", str(tmp_path), "--name", name)
        assert out.returncode == 0, out.stderr
        config, _ = read_run(tmp_path / name)
        assert config["deterministic"]["NCCL_ALGO"] == "Ring" and config["deterministic"]["use_deterministic_algorithms"]
    compared = subprocess.run([sys.executable, "-m", "tools.compare", str(tmp_path / "a"), str(tmp_path / "b"),
                               "--assert-equal"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0, compared.stdout[-3000:] + compared.stderr[-3000:]


def test_combined_1f1b_pairs_on_a_gpu_equal_the_cpu_oracle(tmp_path):
    """--schedule combined on one GPU (the pairs alone, no pipeline): each pair's forward runs in a thread of its
    own, which must take the main thread's device and stream (pp._DeviceContext); the losses and weights of the
    CPU oracle in float64, and the trace shows both threads' exchanges."""
    experts = [*EQUIVALENCE, "--experts", "4", "--top-k", "2", "--micro-batches", "4"]
    out = torchrun(1, "train.py", *experts, "--schedule", "combined", "--ep-overlap", "1", "--profile", "1",
                   "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    run = tmp_path / "gpu1_tp1_pp1_cp1_ep1"
    assert_cuda_run_matches_oracle(run, experts)
    events = json.loads((run / "traces" / "rank0.json").read_text())["traceEvents"]
    threads = {e["tid"] for e in events if e.get("ph") == "X" and e.get("name") == "ep.dispatch c0 start"}
    assert len(threads) > 1


def flex_compilations_on_cuda(dtype_name):
    """How many graphs Dynamo compiled for the one-device core over a run's calls: two training micro-batches of
    new document ids (forward and backward), a layer with a window, and validation under no_grad."""
    from torch._dynamo.utils import counters
    from training.flex import FlexAttentionCore
    device, dtype = torch.device("cuda"), getattr(torch, dtype_name)
    g = torch.Generator(device=device).manual_seed(0)
    core, before = FlexAttentionCore(), counters["stats"]["unique_graphs"]
    for step, cut in enumerate([37, 100, 5]):
        documents = (torch.arange(256, device=device) >= cut).long().expand(2, -1)  # two documents a row
        q = torch.randn(2, 8, 256, 64, device=device, generator=g).to(dtype)
        k, v = (torch.randn(2, 2, 256, 64, device=device, generator=g).to(dtype) for _ in range(2))
        for window in (None, 50):
            if step < 2:  # training
                leaves = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
                core(*leaves, documents, window=window).sum().backward()
            else:
                with torch.no_grad():
                    core(q, k, v, documents, window=window)
    return counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_flexattention_compiles_once_for_a_runs_training_and_validation(dtype):
    """The FlexAttention core compiles once per dtype and head shape: not again for new document ids, a window,
    or validation's no_grad (it runs training's compilation)."""
    compiled, = run_on_ranks(1, flex_compilations_on_cuda, dtype)
    assert compiled == 1


def test_compiled_fp8_with_packed_documents_trains_as_the_uncompiled_run(tmp_path):
    """--compile --fp8 rowwise --document-mask on one GPU in bfloat16 (compiled blocks around FP8's products,
    FlexAttention for the documents) against the same run without --compile: the compiler fuses the element-wise
    work and rounds to bfloat16 at other places, so the losses agree to a few bfloat16 roundings (2^-8 each) of
    the loss, not to the bit."""
    argv = ["--model", "small", "--arch", "llama", "--dtype", "bfloat16", "--fp8", "rowwise", "--document-mask",
            "--eos-id", "0", "--steps", "8", "--eval-interval", "4", "--out", str(tmp_path)]
    logs = []
    for name, flags in (("eager", []), ("compiled", ["--compile"])):
        out = torchrun(1, "train.py", *argv, *flags, "--name", name)
        assert out.returncode == 0, out.stderr
        logs.append(read_run(tmp_path / name)[1])
    for eager, compiled in zip(*logs):
        assert abs(eager["loss"] - compiled["loss"]) <= 4 * 2**-8 * abs(eager["loss"]), (eager["step"], eager["loss"],
                                                                                         compiled["loss"])
