"""training/mfu.py: the FLOPs a token needs (every matrix it meets, and attention over the keys its query sees as
causality, documents and windows make them, counted here pair by pair by model.visible) and the peak each GPU
is held to (the most specific entry of its name; float8's under --fp8, and said)."""
import types

import pytest
import torch
import torch.nn as nn

import cp
import train
from model import GPT, GPTConfig, visible
from training import mfu

TINY = dict(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16)
LLAMA = dict(n_head=4, n_kv_heads=2, position="rope", norm="rms", mlp="swiglu", bias=False, d_ff=40)
LATENT = dict(LLAMA, n_kv_heads=4, kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=2,
              v_head_dim=3)  # DeepSeek's latent attention, narrower values than keys
ARCHS = {"gpt": (0, {}), "gpt-moe": (4, {}), "llama": (0, LLAMA), "llama-moe-shared": (4, dict(LLAMA, n_shared_experts=2)),
         "qwen2-moe": (4, dict(LLAMA, moe_layers=(1,), d_expert=24, n_shared_experts=1, d_shared=20,
                               shared_expert_gate=True)),
         "qwen3": (0, dict(LLAMA, head_dim=6, qk_norm=True)), "latent": (0, LATENT),
         "windowed layer": (0, dict(LLAMA, sliding_window=5, window_layers=(0,)))}
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [0] * 16, [0] * 1 + [1] * 15])  # (rows, seq 16)


def name_of(model, module):
    return next(name for name, m in model.named_modules() if m is module)


@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["one document a row", "documents"])
@pytest.mark.parametrize("arch", ARCHS)
def test_flops_per_token_counts_every_matrix_and_each_key_a_query_sees(arch, documents):
    """6 x (multiply-adds per token): every Linear weight a token meets (for MoE: the router, the shared
    expert and top-k of the experts' weights), and in each layer q kᵀ and p v for each (query, key) pair its
    mask lets through, written out by model.visible, over the batch's tokens."""
    experts, options = ARCHS[arch]
    config = GPTConfig(**{**TINY, **options}, n_experts=experts, top_k=2)
    model = GPT(config)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    expert_weights = sum(m.weight.numel() for m in linears if ".experts." in name_of(model, m))
    dense_weights = sum(m.weight.numel() for m in linears) - expert_weights
    rows, at = 3, torch.arange(config.seq_len)
    pairs = sum(visible(documents, config.window(layer), at, at).expand(rows, -1, -1, -1).sum().item()
                for layer in range(config.n_layer))  # summed over the layers
    per_pair = config.n_head * (config.q_dim // config.n_head + config.v_head_dim)  # q kᵀ, then p v, each head
    per_token = dense_weights + expert_weights * config.top_k // max(experts, 1) + per_pair * pairs / (
        rows * config.seq_len)
    first = None if documents is None else cp.first_keys(documents)
    assert mfu.flops_per_token(config, first) == pytest.approx(6 * per_token, rel=1e-12)


def test_train_counts_the_documents_of_the_global_batch():
    """train.py's packing gives mfu the first keys of the documents of the batch it trains on (EOS-ended)."""
    eos = 9
    tokens = torch.tensor([[1, 2, eos, 3, eos, 4, 5, 6], [1, 1, 1, 1, 1, 1, 1, 1]])
    assert train.OneSequence().first_keys(tokens) is None
    first = train.PackedDocuments(eos).first_keys(tokens)
    assert first.tolist() == [[0, 0, 0, 3, 3, 5, 5], [0] * 7]  # of the inputs: every token but the last


GPUS = {  # a name torch.cuda.get_device_name gives, and the entry it is read from
    "NVIDIA H100 80GB HBM3": ("H100",), "NVIDIA H100 NVL": ("H100", "NVL"), "NVIDIA H100 PCIe": ("H100", "PCIe"),
    "NVIDIA H200": ("H200",), "NVIDIA H200 NVL": ("H200", "NVL"), "NVIDIA A100-SXM4-80GB": ("A100",),
    "NVIDIA A100 80GB PCIe": ("A100",), "NVIDIA L40S": ("L40S",), "NVIDIA L4": ("L4",), "NVIDIA B200": ("B200",),
}


@pytest.mark.parametrize("name", GPUS)
def test_a_gpu_is_held_to_the_peak_of_its_own_part(name):
    """The most specific entry whose words are all the name's: an NVL or PCIe part is not read as the SXM one
    (about 15% apart), an L40S not as an L4."""
    for kind in ("bfloat16", "float32", "float8"):
        assert mfu.device_peak_tflops(name, kind) == mfu.PEAK_TFLOPS[GPUS[name]].get(kind)


def test_the_table_holds_the_data_sheets_relations():
    """Dense figures: on Hopper and Blackwell float8's peak is twice bfloat16's; an NVL or PCIe part has less
    than its SXM part; an unknown GPU, or a product a GPU has no units for (float8 on an A100), has no peak."""
    for part, peaks in mfu.PEAK_TFLOPS.items():
        if part[0] in ("H100", "H200", "B200"):
            assert peaks["float8"] == pytest.approx(2 * peaks["bfloat16"], rel=1e-3), part  # (sheets round)
    for sxm in ("H100", "H200"):
        for other in ("NVL", "PCIe"):
            if (sxm, other) in mfu.PEAK_TFLOPS:
                assert mfu.PEAK_TFLOPS[(sxm, other)]["bfloat16"] < mfu.PEAK_TFLOPS[(sxm,)]["bfloat16"]
    assert mfu.device_peak_tflops("NVIDIA GeForce RTX 4090", "bfloat16") is None
    assert mfu.device_peak_tflops("NVIDIA A100-SXM4-80GB", "float8") is None


@pytest.mark.parametrize("dtype,fp8,kind", [("bfloat16", None, "bfloat16"), ("float16", None, "bfloat16"),
                                            ("float32", None, "float32"), ("bfloat16", "rowwise", "float8")])
def test_the_run_is_held_to_its_products_peak_and_says_which(dtype, fp8, kind):
    """--fp8's MFU is of float8's peak, and its progress line says so; a given --peak-tflops is taken as is."""
    args = types.SimpleNamespace(dtype=dtype, fp8=fp8, peak_tflops=2.0)
    assert mfu.peak_flops(args, torch.device("cpu")) == (2e12, kind)
    assert mfu.peak_flops(types.SimpleNamespace(dtype=dtype, fp8=fp8, peak_tflops=None),
                          torch.device("cpu")) == (None, kind)  # no table on a CPU
    entry = dict(step=3, loss=1.0, tokens_per_s=10.0, mfu=0.25, mfu_of=kind)
    line = train.progress_line(entry, types.SimpleNamespace(pp=1))
    assert "MFU 25.0%" in line and (("of FP8's peak" in line) == (kind == "float8")), line
