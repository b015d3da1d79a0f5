"""gpt-oss's block (--arch gpt-oss): its clamped SwiGLU, its biased router and its YaRN against formulas written
out here as transformers' GptOss modules compute them, and the block with windows, sinks and experts trained
under the layouts equal to one device. Its folders (training/hf.py): MXFP4 experts read back to the values packed
in them, damaged ones refused naming the tensor, the settings model.py cannot represent refused by name, and an
MXFP4 folder exported with its experts dequantized (tests/test_hf.py holds the logits, the layouts and the bit
for bit export of both kinds of folder)."""
import dataclasses
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_models
import model
import train
from distributed import run_on_ranks
from hf_models import _yarn
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan
from test_mxfp4 import e2m1, packed
from tools import convert
from training import checkpoint, cli, hf
from training.tensorfile import DamagedFile


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


def mxfp4_folder(path, seed=0):
    """A tiny gpt-oss folder in MXFP4 whose experts' matrices are known: {X: (codes (experts, rows, in), exponents
    (experts, rows, in / 32))} of each layer's gate_up_proj and down_proj, packed as the format defines them."""
    hf_models.make_folder(path, "gpt_oss_mxfp4")
    tensors, known = load_file(os.path.join(path, "model.safetensors")), {}
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        experts, rows, groups, _ = tensors[name].shape
        codes = torch.randint(0, 16, (experts, rows, groups * 32), generator=g)
        exponents = torch.randint(-12, -2, (experts, rows, groups), generator=g)
        base = name.removesuffix("_blocks")
        tensors[name], tensors[base + "_scales"] = packed(codes.view(experts, rows, groups, 32), exponents)
        known[base] = (codes, exponents)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return known


def values_of(codes, exponents):
    """What the e2m1 codes times their group's powers of two are, from the format's definition (test_mxfp4's)."""
    table = torch.tensor([e2m1(code) for code in range(16)], dtype=torch.float64)
    return table[codes] * torch.exp2(exponents.double()).repeat_interleave(32, dim=-1)


def test_an_mxfp4_folder_loads_to_the_values_packed_in_it(tmp_path):
    """Each expert's gate and up rows (the folder's even and odd rows) and down_proj, exactly, in float64."""
    known = mxfp4_folder(str(tmp_path))
    config = hf.config_from_hf(hf.read_config(str(tmp_path)), seq_len=16)
    state = hf.load_state_dict(str(tmp_path), config)
    for layer in range(config.n_layer):
        gate_up = values_of(*known[f"model.layers.{layer}.mlp.experts.gate_up_proj"])
        down = values_of(*known[f"model.layers.{layer}.mlp.experts.down_proj"])
        for e in range(config.n_experts):
            fc, proj = (state[f"blocks.{layer}.mlp.experts.{e}.{kind}.weight"] for kind in ("fc", "proj"))
            assert torch.equal(fc, torch.cat([gate_up[e, 0::2], gate_up[e, 1::2]]))
            assert torch.equal(proj, down[e])


def test_damaged_mxfp4_experts_are_refused_naming_the_tensor(tmp_path):
    """A scale that is e8m0's NaN, scales of another shape than their blocks, blocks without their scales: each a
    DamagedFile naming the tensor, from train.py's check of the folder (every rank before any step) and from a
    read."""
    folder = str(tmp_path)
    mxfp4_folder(folder)
    config = hf.config_from_hf(hf.read_config(folder), seq_len=16)
    intact = load_file(os.path.join(folder, "model.safetensors"))
    name = "model.layers.2.mlp.experts.down_proj"

    def damaged(**tensors):
        save_file({**{k: v for k, v in intact.items() if k not in tensors}, **{k: v for k, v in tensors.items()
                   if v is not None}}, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})

    scales = intact[name + "_scales"].clone()
    scales[1, 5, 0] = 255
    damaged(**{name + "_scales": scales})
    with pytest.raises(DamagedFile, match=f"{name} \\(MXFP4\\): 1 scales are e8m0's NaN"):
        train.check_folder(folder, config, None)
    with pytest.raises(DamagedFile, match=f"{name}: 1 scales are e8m0's NaN"):
        hf.load_state_dict(folder, config)
    damaged(**{name + "_scales": intact[name + "_scales"][..., :0]})
    with pytest.raises(DamagedFile, match=f"{name} \\(MXFP4\\): blocks .* scales .*: they do not match"):
        train.check_folder(folder, config, None)
    damaged(**{name + "_scales": None})
    with pytest.raises(DamagedFile, match=f"'{name}_blocks' without its MXFP4 pair '{name}_scales'"):
        hf.load_state_dict(folder, config)


GPT_OSS_REFUSED = [({"quantization_config": {"quant_method": "fp8"}}, "quantization_config=.*no other quantisation"),
                   ({"swiglu_limit": 10.0}, "swiglu_limit=10.0: model.py's clamped SwiGLU clamps at 7"),
                   ({"attention_bias": False}, "attention_bias=False: gpt-oss's experts and router have biases"),
                   ({"rope_scaling": dict(hf_models._GPT_OSS["rope_scaling"], truncate="no")}, "truncate is true")]


@pytest.mark.parametrize("setting,refusal", GPT_OSS_REFUSED, ids=[next(iter(s)) for s, _ in GPT_OSS_REFUSED])
def test_gpt_oss_settings_model_py_cannot_represent_are_refused_by_name(setting, refusal):
    with pytest.raises(hf.UnsupportedModel, match=refusal):
        hf.config_from_hf(hf_models.tiny_config("gpt_oss") | setting, seq_len=16)


def test_a_clamped_swiglu_model_that_gpt_oss_cannot_hold_is_refused_by_name():
    """A run of --arch gpt-oss without sinks, or with dense layers, has no Hugging Face architecture here."""
    config = cli.model_config(cli.parse_args(GPT_OSS), 64)
    assert hf.hf_from_config(config)["model_type"] == "gpt_oss"
    for changed, lack in [(dict(n_experts=0), "dense MLPs"), (dict(attention_sinks=False), "attention without sinks")]:
        with pytest.raises(hf.UnsupportedModel, match=f"gpt_oss is the nearest, but has not {lack}"):
            hf.hf_from_config(dataclasses.replace(config, **changed))


def test_an_mxfp4_folder_exports_its_experts_dequantized(tmp_path):
    """Loaded, saved (one step at lr 0), exported: the experts in the run's dtype, exactly the values the MXFP4
    pairs stood for, every other tensor bit for bit, and config.json the folder's without its quantization_config,
    whose logits (the reference reading the export as transformers would) are the released folder's."""
    source, out = str(tmp_path / "released"), str(tmp_path / "exported")
    mxfp4_folder(source)
    argv = [*EQUIVALENCE, "--seq-len", "16", "--steps", "1", "--lr", "0", "--init-from", source,
            "--out", str(tmp_path / "run")]
    run_on_ranks(1, train_worker, argv, timeout=300)
    saved = checkpoint.checkpoints(os.path.join(tmp_path / "run", os.listdir(tmp_path / "run")[0]))[0]
    convert.export_hf(saved, out)
    exported, released = hf.read_config(out), hf.read_config(source)
    assert exported == {k: v for k, v in released.items() if k != "quantization_config"} | dict(torch_dtype="float64")
    _, dequantized = hf_models._load(source)
    written = load_file(os.path.join(out, "model.safetensors"))
    assert written.keys() == dequantized.keys()
    for name, expected in dequantized.items():
        assert torch.equal(written[name], expected), name
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hf_models.reference_logits(out, ids), hf_models.reference_logits(source, ids))
