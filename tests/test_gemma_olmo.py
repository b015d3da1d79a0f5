"""Gemma 3's block (--arch gemma3) and OLMo 2's (--arch olmo2): their pieces against formulas written out here as
transformers' Gemma3 and Olmo2 modules compute them, and each block trained under the layouts equal to one device
and to the plan. Their folders (training/hf.py) are tests/test_hf.py's."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import model
from distributed import run_on_ranks
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan
from training import checkpoint, cli


def gemma_rms(x, weight, eps):
    """Gemma3RMSNorm: computed in float32 (here float64: the test's dtype), scaled by (1 + weight)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def test_gemma_norm_scales_by_one_plus_its_weight():
    x, weight = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    norm = model.OffsetRMSNorm(16, eps=1e-6).double()
    assert torch.equal(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # its initial weight: 0
    with torch.no_grad():
        norm.weight.copy_(weight)
    torch.testing.assert_close(norm(x), gemma_rms(x, weight, 1e-6), rtol=1e-15, atol=1e-15)


def test_the_projection_norm_normalises_every_head_of_a_token_together():
    """Olmo2Attention: q_norm over q_proj's whole output (heads * head_dim features) before the heads are cut."""
    batch, heads, seq, head_dim = 2, 4, 5, 8
    projected, weight = torch.randn(batch, seq, heads * head_dim, dtype=torch.float64), torch.randn(heads * head_dim)
    expected = projected * torch.rsqrt(projected.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    norm = model.ProjectionNorm(heads, head_dim, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(weight)
    got = norm(projected.view(batch, seq, heads, head_dim).transpose(1, 2))
    torch.testing.assert_close(got.transpose(1, 2).reshape(batch, seq, -1), expected, rtol=1e-14, atol=1e-15)


def test_geglu_is_the_tanh_gelu_of_the_gate_times_up():
    gate, up = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    tanh_gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    torch.testing.assert_close(model.geglu(torch.cat([gate, up], -1)), tanh_gelu * up, rtol=1e-14, atol=1e-15)


def test_the_query_scale_and_each_kind_of_layer_rotation():
    """Gemma 3 27B's: scores by query_pre_attn_scalar^-1/2 (168, heads of 128), windowed layers rotating by
    their own base unscaled, the global ones by theirs slowed 8 times (linear scaling)."""
    args = cli.parse_args(["--model", "gemma3-27b", "--arch", "gemma3"])
    config = cli.model_config(args, 262208)
    assert config.window(0) == 1024 and config.window(5) is None and config.window(6) == 1024
    half = torch.arange(64, dtype=torch.float64) / 64
    local = model.rotary_frequencies(config.rotation(0), 128, torch.float64, "cpu")
    world = model.rotary_frequencies(config.rotation(5), 128, torch.float64, "cpu")
    torch.testing.assert_close(local, 10000.0 ** -half, rtol=1e-15, atol=0)
    torch.testing.assert_close(world, 1e6 ** -half / 8, rtol=1e-15, atol=0)
    q, k = torch.randn(2, 1, 3, 128, dtype=torch.float64), torch.randn(2, 1, 3, 128, dtype=torch.float64)
    scaled = F.scaled_dot_product_attention(q * config.query_gain, k, k)  # (the core's 1/sqrt(128) on q's gain)
    expected = torch.softmax(q @ k.transpose(-1, -2) * 168 ** -0.5, dim=-1) @ k
    torch.testing.assert_close(scaled, expected, rtol=1e-13, atol=1e-14)


def test_the_embedding_is_scaled_by_the_root_of_its_width_rounded_to_its_dtype():
    """Gemma3TextScaledWordEmbedding: the scale a tensor of the embedding's dtype (in bfloat16 sqrt(32) is 5.65625)."""
    config = cli.model_config(cli.parse_args(["--model", "tiny", "--arch", "gemma3"]), 64)
    gpt = model.GPT(config).to(torch.bfloat16)
    ids = torch.arange(6).view(1, 6)
    assert torch.equal(gpt.embed(ids, None), gpt.tok_emb(ids) * torch.tensor(math.sqrt(32), dtype=torch.bfloat16))


def test_the_blocks_hold_their_families_norms():
    gemma = dict(model.GPT(cli.model_config(cli.parse_args(["--model", "tiny", "--arch", "gemma3"]), 64))
                 .named_parameters())
    olmo = dict(model.GPT(cli.model_config(cli.parse_args(["--model", "tiny", "--arch", "olmo2"]), 64))
                .named_parameters())
    block = ("norm1", "post_norm1", "norm2", "post_norm2")
    assert all(f"blocks.0.{norm}.weight" in gemma for norm in block) and "lm_head.weight" not in gemma  # tied
    assert not any(name.startswith(("blocks.0.norm1", "blocks.0.norm2")) for name in olmo)
    assert olmo["blocks.0.post_norm1.weight"].shape == (32,)
    assert olmo["blocks.0.attn.q_norm.weight"].shape == (4 * 8,) and olmo["blocks.0.attn.k_norm.weight"].shape == (16,)
    assert gemma["blocks.0.attn.q_norm.weight"].shape == (16,)  # per head, of head_dim
    assert torch.equal(gemma["blocks.0.norm1.weight"], torch.zeros(32))  # (1 + 0): Gemma's norms start as identities


# Published parameter counts: Gemma 3's technical report (Table 1: embedding + non-embedding parameters of the
# language model, in millions), OLMo 2's release (7.30B, "2 OLMo 2 Furious", Table 1).
PUBLISHED = {"gemma3-1b": ("gemma3", (302 + 698) * 10 ** 6), "gemma3-27b": ("gemma3", (1416 + 25600) * 10 ** 6),
             "olmo2-7b": ("olmo2", 7.30e9)}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_the_presets_have_the_published_parameter_counts(preset):
    arch, published = PUBLISHED[preset]
    config = cli.model_config(cli.parse_args(["--model", preset, "--arch", arch]), cli.PRESETS[preset]["vocab_size"])
    with torch.device("meta"):
        count = sum(p.numel() for p in model.GPT(config).parameters())
    assert abs(count - published) <= 0.005 * published, (count, published)


GEMMA = [*EQUIVALENCE, "--arch", "gemma3", "--sliding-window", "5", "--window-layers", "1:1", "--seq-len", "16"]
OLMO = [*EQUIVALENCE, "--arch", "olmo2", "--seq-len", "16"]
OLMO3 = [*OLMO, "--sliding-window", "5", "--window-layers", "1:1"]  # OLMo 3's windows, on every second layer here
PIPELINED = ["--layers", "4", "--micro-batches", "4"]

# (ranks, the experiment's flags (the oracle's too), the layout's)
LAYOUTS = [
    (2, GEMMA, ["--tp", "2", "--sp"]),
    (2, GEMMA, ["--cp", "2", "--cp-mode", "ring"]),
    (2, GEMMA, ["--cp", "2", "--cp-mode", "allgather"]),
    (2, GEMMA, ["--cp", "2", "--cp-mode", "alltoall"]),
    (2, GEMMA + PIPELINED, ["--pp", "2", "--schedule", "zbv"]),
    (2, GEMMA, ["--zero", "3"]),  # the tied embedding lent to the output layer
    (4, GEMMA, ["--zero", "3", "--dp-shard", "2", "--recompute", "full"]),  # hybrid sharding
    (2, OLMO, ["--tp", "2"]),  # QK-norm's squares summed over the heads of both ranks
    (2, OLMO3, ["--tp", "2", "--sp", "--recompute", "selective"]),
    (2, OLMO3, ["--cp", "2", "--cp-mode", "ring"]),
    (2, OLMO, ["--cp", "2", "--cp-mode", "allgather"]),
    (2, OLMO3, ["--cp", "2", "--cp-mode", "alltoall"]),
    (2, OLMO + PIPELINED, ["--pp", "2", "--schedule", "zbv"]),
    (4, OLMO3, ["--tp", "2", "--zero", "3", "--recompute", "full"]),
]


def layout_id(world, model_flags, flags):
    return "-".join(["gemma3" if model_flags[:len(GEMMA)] == GEMMA else "olmo3" if model_flags[:len(OLMO3)] == OLMO3
                     else "olmo2", *(f.lstrip("-") for f in flags)])


@pytest.mark.full
@pytest.mark.parametrize("world,model_flags,flags", LAYOUTS, ids=[layout_id(*layout) for layout in LAYOUTS])
def test_the_blocks_train_as_one_device_under_every_layout(tmp_path, world, model_flags, flags):
    """Gemma's sandwich of (1 + w) norms, its per-kind rotation, query scale, GeGLU and scaled tied embedding;
    OLMo's norms after each sub-layer and QK-norm over the whole projection (its statistics spanning tp's
    ranks): each layout equal to one device, and to the plan."""
    argv = [*model_flags, *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle(model_flags))
    assert_matches_plan(tmp_path, argv, world)


# The plan in the narrower dtypes (where the norms' float32 copies and statistics are tensors of their own):
# Gemma's (1 + w) norms and OLMo's whole-projection QK-norm, what they keep and send.
NARROW = [(2, [*GEMMA, "--dtype", "bfloat16", "--tp", "2", "--sp"]),
          (2, [*OLMO3, "--dtype", "bfloat16", "--tp", "2", "--recompute", "selective"]),
          (2, [*OLMO, "--dtype", "float32", "--cp", "2", "--cp-mode", "alltoall", "--experts", "4", "--top-k", "2"])]


@pytest.mark.full
@pytest.mark.parametrize("world,flags", NARROW, ids=[layout_id(w, f, f[len(EQUIVALENCE) + 2:]) for w, f in NARROW])
def test_the_blocks_in_narrower_dtypes_keep_and_send_what_the_plan_says(tmp_path, world, flags):
    run_on_ranks(world, train_worker, [*flags, "--out", str(tmp_path)], timeout=300)
    assert_matches_plan(tmp_path, flags, world)


@pytest.mark.full
def test_a_split_projection_norm_resumes_under_another_layout(tmp_path):
    """OLMo's QK-norm weights saved by tp 2 (each rank its heads' half) and resumed under cp 2 whole: the steps
    after the resume as one device's."""
    argv = [*OLMO, "--steps", "4"]
    first = run_on_ranks(2, train_worker, [*argv, "--tp", "2", "--stop-at", "2", "--out", str(tmp_path / "a")])[0]
    (run,) = os.listdir(tmp_path / "a")
    saved = checkpoint.checkpoints(str(tmp_path / "a" / run))[0]
    second = run_on_ranks(2, train_worker, [*argv, "--cp", "2", "--resume", saved, "--out", str(tmp_path / "b")])
    for result in second:
        assert_matches_oracle(dict(losses=first["losses"] + result["losses"], state_dict=result["state_dict"]),
                              oracle(argv))


def test_a_projection_norm_among_gemmas_norms_is_refused():
    """Its weights would start at Gemma's 0 (every norm's by name, GPTConfig.norm_weight), zeroing q and k."""
    with pytest.raises(ValueError, match="QK-norm over a whole projection is OLMo 2's RMSNorm"):
        model.GPTConfig(position="rope", norm="rms_offset", qk_norm=True, qk_norm_scope="projection")
