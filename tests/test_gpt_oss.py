"""gpt-oss's block (--arch gpt-oss): its clamped SwiGLU, its biased router and its YaRN against formulas written
out here as transformers' GptOss modules compute them, and the block with windows, sinks and experts trained
under the layouts equal to one device."""
import math

import pytest
import torch

import model
from distributed import run_on_ranks
from hf_models import _yarn
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan
from training import cli


def test_the_clamped_swiglu_is_gpt_oss_gate_on_interleaved_halves():
    """transformers' GptOssExperts._apply_gate reads gate and up interleaved (even and odd features); model.py
    holds them as (gate | up) halves: the same values through both, clamps reached on both sides."""
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(5, 8, dtype=torch.float64, generator=g) * 6 for _ in range(2))
    interleaved = torch.stack([gate, up], dim=-1).flatten(-2)
    gate_oss, up_oss = interleaved[..., ::2].clamp(max=7.0), interleaved[..., 1::2].clamp(min=-7.0, max=7.0)
    expected = (up_oss + 1) * (gate_oss * torch.sigmoid(gate_oss * 1.702))
    assert gate.max() > 7 and up.min() < -7 and up.max() > 7
    assert torch.equal(model.clamped_swiglu(torch.cat([gate, up], dim=-1)), expected)


def test_the_biased_router_softmaxes_its_top_k_logits():
    """GptOssTopKRouter: the k largest of x Wᵀ + b, softmaxed among themselves; model.route: the k largest of the
    softmax over all experts, renormalised: the same experts and gates."""
    config = model.GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16, n_experts=8, top_k=3,
                             router_bias=True)
    moe = model.MoE(config).double()
    torch.nn.init.normal_(moe.router.bias)
    x = torch.randn(10, 16, dtype=torch.float64)
    logits = x @ moe.router.weight.T + moe.router.bias
    top, chosen = logits.topk(3, dim=-1)
    gates, experts, _ = model.route(moe.router(x), 3)
    assert torch.equal(experts, chosen)
    torch.testing.assert_close(gates, top.softmax(-1), rtol=1e-14, atol=1e-15)


def test_yarn_without_truncation_is_transformers_with_truncate_false():
    """gpt-oss's rope_scaling: yarn, factor 32 over 4,096 positions, beta 32 and 1, truncate false: the ramp's
    ends where they fall (rounded, the frequencies differ)."""
    args = cli.parse_args(["--model", "tiny", "--arch", "gpt-oss", "--head-dim", "64"])
    config = cli.model_config(args, 64)
    rope = dict(rope_theta=config.rope_theta, factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                beta_slow=1.0, truncate=False)
    hf = dict(max_position_embeddings=4096 * 32)
    expected, gain = _yarn(hf, rope, 64)
    torch.testing.assert_close(model.rotary_frequencies(config, 64, torch.float64, "cpu"), expected, rtol=1e-14,
                               atol=0)
    assert model.yarn_gains(config)[0] == pytest.approx(gain) == pytest.approx(0.1 * math.log(32) + 1)
    rounded, _ = _yarn(hf, dict(rope, truncate=True), 64)
    assert not torch.allclose(rounded, expected)


GPT_OSS = [*EQUIVALENCE, "--arch", "gpt-oss", "--kv-heads", "2", "--experts", "4", "--top-k", "2",
           "--sliding-window", "5", "--window-layers", "1:1", "--seq-len", "16"]

# (ranks, the experiment's flags (the oracle's too), the layout's)
LAYOUTS = [
    (2, [], ["--tp", "2", "--sp"]),
    (2, [], ["--cp", "2", "--cp-mode", "ring"]),
    (2, [], ["--cp", "2", "--cp-mode", "allgather"]),
    (2, [], ["--cp", "2", "--cp-mode", "alltoall"]),
    (2, [], ["--tp", "2", "--ep", "2"]),  # experts folded over tp
    (2, [], ["--tp", "2", "--expert-tp", "2"]),
    (2, ["--layers", "4", "--micro-batches", "4"], ["--pp", "2", "--schedule", "zbv"]),
    (2, [], ["--zero", "3", "--recompute", "full"]),
    (2, [], ["--tp", "2", "--recompute", "full"]),
]


def layout_id(world, model_flags, flags):
    return "-".join(f.lstrip("-") for f in flags + model_flags)


@pytest.mark.full
@pytest.mark.parametrize("world,model_flags,flags", LAYOUTS, ids=[layout_id(*layout) for layout in LAYOUTS])
def test_the_gpt_oss_block_trains_as_one_device_under_every_layout(tmp_path, world, model_flags, flags):
    """Windows on every second layer, sinks, biases on q, k, v, o, the router and the experts, the clamped
    SwiGLU and YaRN: each layout equal to one device, and to the plan."""
    argv = [*GPT_OSS, *model_flags, *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*GPT_OSS, *model_flags]))
    assert_matches_plan(tmp_path, argv, world)


def test_the_gpt_oss_block_has_gpt_oss_parameters():
    config = cli.model_config(cli.parse_args(GPT_OSS), 64)
    names = dict(model.GPT(config).named_parameters())
    assert {"blocks.0.attn.qkv.bias", "blocks.0.attn.proj.bias", "blocks.0.attn.sinks", "blocks.1.mlp.router.bias",
            "blocks.1.mlp.experts.3.fc.bias", "blocks.1.mlp.experts.3.proj.bias"} <= set(names)
    assert not any(name.endswith("norm1.bias") for name in names)  # RMSNorm: no bias
    assert config.window(0) == 5 and config.window(1) is None
