"""Model FLOPs utilisation: the FLOPs a step's model needs, over the time it took, over the devices' peak.

- `flops_per_token(config, first)`: 6 x the multiply-adds a token needs (forward 2 FLOPs each, backward 4;
  recomputation not counted, as MFU does not): every weight matrix it passes through (an MoE layer's
  router, its top-k experts, the shared expert and its gate), and attention's q kᵀ and p v over the keys
  its query sees as the masks make them, causality, documents and windows (the kernels skip the rest);
- `peak_flops(args, device)`: one device's dense peak for the run's products, by the GPU's name
  (`PEAK_TFLOPS`), labelled: bfloat16's (float16's), float32's, or float8's for `--fp8` (whose attention
  and other products still run in bfloat16: MFU against FP8's peak says how far the run is from it).
"""
import re

import torch

# Dense (no sparsity) TFLOP/s of one GPU, by the words of its name, from NVIDIA's data sheets: H100 and H200
# (SXM, NVL, PCIe: "NVIDIA H100 Tensor Core GPU", "NVIDIA H200 Tensor Core GPU"), B200 (HGX B200's 8 GPUs,
# divided by 8), A100, L40S, L4, A10G. The sheets print tensor figures "with sparsity", twice the dense
# ones given here; float32 is without TF32 (PyTorch's default for float32 products).
PEAK_TFLOPS = {
    ("H100",): dict(bfloat16=989.5, float32=67, float8=1979),
    ("H100", "NVL"): dict(bfloat16=835.5, float32=60, float8=1670.5),
    ("H100", "PCIe"): dict(bfloat16=756.5, float32=51, float8=1513),
    ("H200",): dict(bfloat16=989.5, float32=67, float8=1979),
    ("H200", "NVL"): dict(bfloat16=835.5, float32=60, float8=1670.5),
    ("B200",): dict(bfloat16=2250, float32=75, float8=4500),
    ("A100",): dict(bfloat16=312, float32=19.5),
    ("L40S",): dict(bfloat16=362, float32=91.6, float8=733),
    ("L4",): dict(bfloat16=121, float32=30.3, float8=242.5),
    ("A10G",): dict(bfloat16=70, float32=31.2),
}


def device_peak_tflops(name, kind):
    """The table's dense TFLOP/s for products of `kind` on the GPU named `name` (torch.cuda.get_device_name),
    or None: the entry whose words are all words of the name, the most specific first ("NVIDIA H100 NVL" is
    the NVL part, not the SXM one, whose entry is "H100" alone)."""
    words = set(re.split(r"[^A-Za-z0-9]+", name))
    matches = [part for part in PEAK_TFLOPS if set(part) <= words]
    if not matches:
        return None
    return PEAK_TFLOPS[max(matches, key=len)].get(kind)


def peak_kind(args):
    """Which of a device's peaks the run's products are held to: float8 under --fp8, else its dtype's."""
    if getattr(args, "fp8", None):
        return "float8"
    return "bfloat16" if args.dtype == "float16" else args.dtype


def peak_flops(args, device):
    """(one device's peak FLOP/s for this run, its kind): --peak-tflops, else the table's (CUDA only), else
    (None, kind)."""
    kind = peak_kind(args)
    if args.peak_tflops:
        return args.peak_tflops * 1e12, kind
    if device.type != "cuda":
        return None, kind
    tflops = device_peak_tflops(torch.cuda.get_device_name(device), kind)
    return (tflops and tflops * 1e12), kind


def keys_per_query(first, window, seq_len):
    """The mean number of keys a query sees over a batch: query i sees keys max(first[b, i], i - window + 1)
    to i, first its document's first token ((batch, seq) on the host; None: one document a row), window
    None: no window."""
    index = torch.arange(seq_len)
    lo = torch.zeros(seq_len, dtype=torch.long) if first is None else first
    if window is not None:
        lo = torch.maximum(lo, index - window + 1)
    return (index - lo + 1).double().mean().item()


def matrix_multiply_adds(config):
    """Multiply-adds of one token through every weight matrix of the model."""
    d, h = config.d_model, config.n_head
    if config.kv_lora_rank:  # latent attention: low-rank queries, keys and values (model.LatentAttention)
        queries = (d * config.q_lora_rank + config.q_lora_rank * config.q_dim) if config.q_lora_rank else \
            d * config.q_dim
        keys_values = d * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank * h * (
            config.qk_nope_head_dim + config.v_head_dim)
        attention = queries + keys_values + config.v_dim * d
    else:  # q and proj, k and v
        attention = 2 * d * config.q_dim + 2 * d * config.kv_dim
    per_unit = (3 if config.gated else 2) * d  # an MLP's per hidden unit: SwiGLU has a gate matrix too
    mlp = per_unit * config.d_ff
    moe = per_unit * (config.top_k * config.d_expert + config.d_shared) + d * (
        config.n_experts + config.shared_expert_gate)
    per_layer = [attention + (moe if config.is_moe(i) else mlp) for i in range(config.n_layer)]
    return sum(per_layer) + d * config.padded_vocab_size


def flops_per_token(config, first=None, seq_len=None):
    """Training FLOPs per token of a batch: 6 x (the matrices' multiply-adds, and in each layer q kᵀ and p v,
    q_dim + n_head x v_head_dim multiply-adds per key a query sees under its layer's window); first: the
    batch's first keys (`keys_per_query`), None: one document a row; seq_len: the batch's (config's)."""
    seq_len = seq_len or config.seq_len
    per_key = config.q_dim + config.n_head * config.v_head_dim
    windows = [config.window(layer) for layer in range(config.n_layer)]
    keys = {window: keys_per_query(first, window, seq_len) for window in set(windows)}  # layers share few
    attention = per_key * sum(keys[window] for window in windows)
    return 6 * (matrix_multiply_adds(config) + attention)
