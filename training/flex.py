"""What a query sees, on CUDA: FlexAttention's block masks in place of cp.py's tiles.

cp.py's one-device core computes only the tiles a query sees, each a call of PyTorch's fused attention, merged
by the online softmax; that runs everywhere, and it is the CPU's path (FlexAttention has no CPU backward).
On a GPU one compiled FlexAttention kernel does the same work in one call: it is handed, for every block of
128 queries, the blocks of 128 keys some query sees (masked inside by `visible`) and those every query sees
(no mask), from the same first-key arithmetic as cp.VisibleMasks, so it too keeps no (seq, seq) tensor.

`FlexAttentionCore` is the core train.py installs on one device: it takes FlexAttention where it applies
(`flex_applies`: CUDA, documents or a window, head sizes the kernel takes) and cp.py's core otherwise, at run
time, call by call. tests/test_flex.py holds it to cp.py's core on CPUs (forward: FlexAttention's CPU
kernel; backward: the same block mask densified), tests/test_cuda.py on a GPU, forward and backward.
"""
import contextlib
import functools

import torch

import cp
from training.cli import ConfigError

try:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
except ImportError:  # a PyTorch without FlexAttention's auxiliary outputs: cp.py's core everywhere
    flex_attention = None

BLOCK = 128  # FlexAttention's block of queries and of keys


def flex_applies(q, v, documents, window):
    """Whether FlexAttention takes this call: on CUDA, where something masks more than causality (plain
    causal attention is the fused kernels' own best case), in the dtypes and head sizes its kernels take."""
    return (flex_attention is not None and q.is_cuda and (documents is not None or window is not None)
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.shape[-1] == v.shape[-1] and q.shape[-1] >= 16 and q.shape[-1] & (q.shape[-1] - 1) == 0)


def first_visible_key(documents, window, batch, seq_len, device):
    """lo (batch, seq): query i sees keys lo[b, i]..i, the later of its document's first token and
    i - window + 1 (as cp.VisibleMasks); lo never decreases along a row."""
    index = torch.arange(seq_len, device=device)
    lo = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    if documents is not None:
        lo = cp.first_keys(documents)
    if window is not None:
        lo = torch.maximum(lo, index - window + 1)
    return lo.expand(batch, seq_len).contiguous()  # one layout for every mask: Dynamo guards on strides


@functools.lru_cache(maxsize=8)  # every layer of a micro-batch asks with the same ids tensor (cp._visible_masks)
def visible_block_mask(documents, window, batch, seq_len, device):
    """The BlockMask of what each query sees, built from lo at the blocks' corners, O((seq / 128)^2):
    block (queries qs..qe-1, keys ks..ke-1) holds a seen key if the first query at or after ks sees a key
    before ke (lo does not decrease); every query sees every key of it if the last query's lo is at most ks
    and the first query comes at or after ke - 1."""
    lo = first_visible_key(documents, window, batch, seq_len, device)
    starts = torch.arange(0, seq_len, BLOCK, device=device)
    ends = torch.clamp(starts + BLOCK, max=seq_len)
    first_at_or_after = torch.maximum(starts.view(-1, 1), starts.view(1, -1))  # (query block, key block)
    some = (first_at_or_after < ends.view(-1, 1)) & (
        lo[:, first_at_or_after.clamp(max=seq_len - 1)] < ends.view(1, -1))
    every = (lo[:, ends - 1].unsqueeze(-1) <= starts.view(1, 1, -1)) & (starts.view(-1, 1) >= ends.view(1, -1) - 1)

    def visible(b, h, query, key):  # one function for every mask: one compilation (its code is guarded on)
        return (key <= query) & (key >= lo[b, query])

    return BlockMask.from_kv_blocks(*_ordered(some & ~every), *_ordered(every), BLOCK_SIZE=BLOCK, mask_mod=visible,
                                    seq_lengths=(seq_len, seq_len))


def _ordered(blocks):
    """(count, indices) of the True key blocks of each query block, (batch, 1 head, query blocks[, key
    blocks]) int32, the indices of the True ones first, as BlockMask reads them."""
    blocks = blocks.unsqueeze(1)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return blocks.sum(-1).to(torch.int32), indices.to(torch.int32)


@functools.cache
def compiled_flex_attention():
    """FlexAttention compiled (uncompiled, it runs a reference that holds every score) for static shapes: every
    micro-batch of a run has one shape, in training and in validation alike (train.py's batches), and every
    mask one mask_mod (`visible_block_mask`), so it compiles once per dtype and head shape. Past Dynamo's
    recompile limit a compiled function runs uncompiled, here that reference, out of memory at length: the
    limit is an error instead, in one line."""
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(*args, **kwargs):
        with _recompile_limit_fails():
            try:
                return compiled(*args, **kwargs)
            except RecompileLimitHit as e:
                raise ConfigError(f"FlexAttention compiled {torch._dynamo.config.recompile_limit} times, Dynamo's "
                                  "recompile limit (attention of more shapes than a run's one micro-batch shape, "
                                  f"or of more dtypes and head shapes): {str(e).splitlines()[0]}") from None

    return attend


# Dynamo's switch from a silent fall-back to an error at its recompile limit (PyTorch 2.6 and newer; internal)
RecompileLimitHit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())


def _recompile_limit_fails():
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
    return contextlib.nullcontext()


def flex_one_device_attention(q, k, v, documents=None, window=None, sinks=None, attend=None):
    """cp.one_device_attention's output by FlexAttention over `visible_block_mask`; with sinks (heads,) merged
    into each row as cp.WithSinks does, out * exp(lse - L), L = log(exp(lse) + exp(sink)), through autograd
    (FlexAttention's backward takes the log-sum-exp's gradient). `attend`: FlexAttention itself by default."""
    attend = attend or compiled_flex_attention()
    mask = visible_block_mask(documents, window, q.shape[0], q.shape[2], q.device)
    if sinks is None:
        return attend(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    out, aux = attend(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1],
                      return_aux=AuxRequest(lse=True))
    merged = torch.promote_types(out.dtype, torch.float32)  # the softmax's own precision (cp.merge's)
    lse = aux.lse.to(merged)
    with_sink = torch.logaddexp(lse, sinks.to(merged).view(-1, 1))
    return (out.to(merged) * torch.exp(lse - with_sink).unsqueeze(-1)).to(out.dtype)


class FlexAttentionCore(cp.AttentionCore):
    """cp.AttentionCore, with FlexAttention wherever it applies (`flex_applies`), chosen call by call."""

    def __call__(self, q, k, v, documents=None, window=None, sinks=None):
        if not flex_applies(q, v, documents, window):
            return super().__call__(q, k, v, documents, window=window, sinks=sinks)
        if torch.is_grad_enabled():
            return flex_one_device_attention(q, k, v, documents, window, sinks)
        # Validation (no_grad) runs the kernel compiled for training: Dynamo guards on the grad mode and on the
        # inputs' requires_grad, so a no_grad call would compile anew. The graph this builds holds what
        # FlexAttention saves (q, k, v, its output and log-sum-exp; no scores) and goes with the result.
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            return flex_one_device_attention(q, k, v, documents, window, sinks).detach()
