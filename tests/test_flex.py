"""training/flex.py, FlexAttention's block masks for what a query sees: its blocks hold exactly the visible
pairs, and its core equals cp.py's in float64, forward by FlexAttention's own CPU kernel, backward (which
FlexAttention does not have on CPUs) through the same block mask written out. tests/test_cuda.py runs the
compiled kernel on a GPU, forward and backward."""
import types
import warnings

import pytest
import torch

import cp
import model
from training import flex

pytestmark = pytest.mark.skipif(flex.flex_attention is None, reason="this PyTorch has no FlexAttention")

SEQ = 300  # two whole blocks of 128 and a part one


def packed(lengths):
    """Document ids (rows, seq) of rows of documents of the given lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


DOCUMENTS = packed([[37, 140, 3, 120], [300]])  # a document within a block, over two, of three tokens, whole
CASES = {"documents": (DOCUMENTS, None), "window": (None, 50), "window over blocks": (None, 200),
         "documents and window": (DOCUMENTS, 70), "window longer than any document": (DOCUMENTS, 290)}


def key_blocks(count, indices):
    """(rows, query blocks, key blocks) bool: the blocks a BlockMask's (count, indices) name."""
    blocks = torch.zeros(*indices.shape[:1], *indices.shape[2:], dtype=torch.bool)
    for row, block in torch.ones_like(count[:, 0], dtype=torch.bool).nonzero().tolist():
        blocks[row, block, indices[row, 0, block, :count[row, 0, block]].long()] = True
    return blocks


def written_out(mask, rows):
    """(rows, 1, seq, seq): what a BlockMask lets each query see, pair by pair: every pair of its full blocks,
    and the pairs of its other blocks its mask_mod lets through."""
    partial, full = (key_blocks(*counts).repeat_interleave(flex.BLOCK, 1).repeat_interleave(flex.BLOCK, 2)
                     [:, :SEQ, :SEQ] for counts in ((mask.kv_num_blocks, mask.kv_indices),
                                                    (mask.full_kv_num_blocks, mask.full_kv_indices)))
    at = torch.arange(SEQ)
    pairs = torch.stack([mask.mask_mod(torch.tensor(row), 0, at.view(-1, 1), at.view(1, -1))
                         for row in range(rows)])
    return (full.expand(rows, -1, -1) | partial.expand(rows, -1, -1) & pairs).unsqueeze(1)


@pytest.mark.parametrize("case", CASES)
def test_the_blocks_hold_exactly_what_each_query_sees(case):
    """Block by block: named full exactly where every pair is visible, named (and masked) where only some are,
    left out where none is; pair by pair, model.visible."""
    documents, window = CASES[case]
    mask = flex.visible_block_mask(documents, window, 2, SEQ, torch.device("cpu"))
    at = torch.arange(SEQ)
    seen = model.visible(documents, window, at, at)[:, 0].expand(2, -1, -1)
    padded = torch.zeros(2, 3 * flex.BLOCK, 3 * flex.BLOCK, dtype=torch.long)  # (visible pairs, pairs) a block
    padded[:, :SEQ, :SEQ] = seen
    per_block = padded.unflatten(1, (3, flex.BLOCK)).unflatten(3, (3, flex.BLOCK)).sum((2, 4))
    in_range = torch.tensor([128, 128, SEQ - 256])
    every, some = per_block == in_range.view(-1, 1) * in_range.view(1, -1), per_block > 0
    full = key_blocks(mask.full_kv_num_blocks, mask.full_kv_indices)
    partial = key_blocks(mask.kv_num_blocks, mask.kv_indices)
    assert torch.equal(full.expand(2, -1, -1), every)
    assert torch.equal(partial.expand(2, -1, -1), some & ~every)
    assert torch.equal(written_out(mask, 2), seen.unsqueeze(1))


def dense_flex(q, k, v, block_mask, enable_gqa, return_aux):
    """FlexAttention's result and log-sum-exp, written out from the block mask (`written_out`): its backward is
    autograd's, which FlexAttention lacks on CPUs."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(~written_out(block_mask, q.shape[0]),
                                                                        float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.softmax(scores, -1) @ v, types.SimpleNamespace(lse=lse)


def inputs(sinks):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, SEQ, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, SEQ, 16, dtype=torch.float64, generator=g) for _ in range(2))  # GQA
    return [q, k, v] + ([torch.randn(4, dtype=torch.float64, generator=g)] if sinks else [])


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("case", CASES)
def test_flexattention_forward_equals_the_tiles(case, sinks):
    """FlexAttention's CPU kernel (uncompiled) over the block mask, sinks merged, against cp.py's tiles."""
    documents, window = CASES[case]
    q, k, v, *s = inputs(sinks)
    tiles = cp.one_device_attention(q, k, v, documents=documents, window=window, sinks=s[0] if s else None)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": this is the point
        out = flex.flex_one_device_attention(q, k, v, documents, window, *s, attend=flex.flex_attention)
    assert (out - tiles).abs().max() < 1e-12


@pytest.mark.parametrize("case", ["documents and window", "window"])
def test_gradients_through_the_block_mask_and_sinks_equal_the_tiles(case):
    """dQ, dK, dV and the sinks' gradient through the block mask written out and the sinks' merge (autograd
    through the log-sum-exp, as FlexAttention's backward takes it), against cp.py's tiles."""
    documents, window = CASES[case]
    grads = []
    for attention in (lambda q, k, v, sinks: cp.one_device_attention(q, k, v, documents=documents, window=window,
                                                                     sinks=sinks)[0],
                      lambda q, k, v, sinks: flex.flex_one_device_attention(q, k, v, documents, window, sinks,
                                                                            attend=dense_flex)):
        leaves = [t.requires_grad_() for t in inputs(sinks=True)]
        (attention(*leaves) * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum().backward()
        grads.append([t.grad for t in leaves])
    for tiles, flexed in zip(*grads):
        assert (tiles - flexed).abs().max() < 1e-12


def test_the_core_takes_cp_cores_way_where_flexattention_does_not_apply():
    """On CPUs, or for plain causal attention anywhere, FlexAttentionCore is cp.AttentionCore to the bit."""
    q, k, v = inputs(sinks=False)
    assert not flex.flex_applies(q, v, DOCUMENTS, None)  # a CPU tensor
    for documents, window in CASES.values():
        assert torch.equal(flex.FlexAttentionCore()(q, k, v, documents, window=window),
                           cp.AttentionCore()(q, k, v, documents, window=window))


def graphs_compiled():
    """Dynamo's count of the graphs it compiled in this process (an internal counter, read as a difference)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@pytest.mark.full  # one compilation by the C++ compiler, about a minute on 2 cores with a cold cache
def test_one_compilation_takes_every_micro_batch_and_mask_of_a_run():
    """The compiled kernel (static shapes: a run's micro-batches have one shape, training's and validation's)
    compiles once for the micro-batches of a run, each with its own document ids, and every kind of mask
    (documents, windows of two sizes, both): one mask_mod, the masks its data. On CPUs FlexAttention compiles
    inference only, without the log-sum-exp sinks need: no sinks here (tests/test_cuda.py compiles training)."""
    g = torch.Generator().manual_seed(1)
    before, attend = graphs_compiled(), flex.compiled_flex_attention()
    for step, (documents, window) in enumerate([(DOCUMENTS, None), (None, 50), (DOCUMENTS.flip(1), 70),
                                                (None, 200), (packed([[300], [150, 150]]), None)]):
        q = torch.randn(2, 4, SEQ, 16, generator=g)
        k, v = (torch.randn(2, 2, SEQ, 16, generator=g) for _ in range(2))
        with torch.no_grad():
            out = flex.flex_one_device_attention(q, k, v, documents, window, attend=attend)
        tiles = cp.one_device_attention(q, k, v, documents=documents, window=window)[0]
        assert (out - tiles).abs().max() < 1e-5, step  # float32: the kernel's order of sums is its own
        assert graphs_compiled() - before == 1, f"micro-batch {step} compiled FlexAttention again"
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(flex.ConfigError) as error:
        flex.flex_one_device_attention(q[:1], k[:1], v[:1], None, 50, attend=attend)  # another shape
    assert "recompile limit" in str(error.value) and "\n" not in str(error.value)


def test_validation_runs_the_kernel_compiled_for_training(monkeypatch):
    """Under no_grad (validation) the core calls FlexAttention as training does, grad enabled and the inputs
    requiring grad, so Dynamo's guards (grad mode, requires_grad) take training's compilation; its result is
    training's, with no graph kept."""
    calls = []

    def recording(q, k, v, block_mask, enable_gqa, return_aux=None):
        calls.append((torch.is_grad_enabled(), q.requires_grad, k.requires_grad, v.requires_grad))
        return dense_flex(q, k, v, block_mask, enable_gqa, return_aux)[0 if return_aux is None else slice(None)]

    monkeypatch.setattr(flex, "flex_applies", lambda *_: True)  # as on CUDA
    monkeypatch.setattr(flex, "compiled_flex_attention", lambda: recording)
    q, k, v, sinks = [t.requires_grad_() for t in inputs(sinks=True)]
    for with_sinks in (None, sinks):
        trained = flex.FlexAttentionCore()(q, k, v, DOCUMENTS, window=70, sinks=with_sinks)
        with torch.no_grad():
            validated = flex.FlexAttentionCore()(q, k, v, DOCUMENTS, window=70, sinks=with_sinks)
        assert calls[-2] == calls[-1] == (True, True, True, True)
        assert torch.equal(trained, validated) and not validated.requires_grad and validated.grad_fn is None
