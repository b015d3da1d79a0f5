"""Context parallelism: ring attention, the all-gather and the all-to-all equal full causal attention, and
within packed documents (the ring skipping the blocks and messages no query needs); training equals the
single device, alone and composed, with the memory and traffic tools/plan/ predicts."""

import pytest
import torch
import torch.distributed as dist

from training import cli
from tools import plan
import cp
import model
from distributed import run_on_ranks, self_check_alone
from training.meter import ActivationMeter
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan

B, H, D = 2, 3, 8  # batch, heads, head_dim of the unit tests


def document_mask(documents, window=None):
    """(batch, 1, seq, seq): query i sees key j iff j <= i and both are in the same document (and, with a
    window, i - j < window)."""
    at = torch.arange(documents.shape[1])
    earlier = (at[None, :] <= at[:, None]) & (at[:, None] - at[None, :] < (window or documents.shape[1]))
    return (earlier & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)


def full_causal_attention(q, k, v, documents=None, window=None, sinks=None):
    """softmax(q k^T / sqrt(d) + causal mask) v and its log-sum-exp, written out, within documents if given
    (batch, seq) and a window if given; with sinks (heads,), each head's in the softmax's denominator; k and v
    may have fewer heads than q, each serving consecutive query heads (grouped-query attention)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if documents is None and window is None:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    else:
        one_document = torch.zeros(1, q.shape[2], dtype=torch.long)
        scores = scores.masked_fill(~document_mask(one_document if documents is None else documents, window),
                                    float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
    lse = scores.logsumexp(-1)
    return (torch.exp(scores - lse.unsqueeze(-1)) @ torch.cat([v, torch.zeros_like(v[:, :, :1])], 2)
            if sinks is not None else torch.exp(scores - lse.unsqueeze(-1)) @ v), lse


def attention_inputs(seq_len, heads, kv_heads):
    """(full q, k, v after full causal attention's backward, its output and log-sum-exp, this rank's shards of
    q, k, v, a function giving this rank's shard of a full tensor, the output gradient's shard), float64."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(B, heads, seq_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, seq_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, expected_lse = full_causal_attention(*full)
    expected.backward(grad)
    mine = lambda t: cp.shard_sequence(t, n, rank, dim=2)  # noqa: E731
    local = [mine(t).requires_grad_() for t in (q, k, v)]
    return full, expected, expected_lse, local, mine, mine(grad)


def ring_worker(seq_len, kv_heads, kernels):
    full, expected, expected_lse, local, mine, grad = attention_inputs(seq_len, H, kv_heads)
    cp.comm_bytes.clear(), cp.blocks_computed.clear()
    meter = ActivationMeter()
    with meter:
        out, lse = cp.ring_attention(*local, None, kernels=getattr(cp, kernels))
    forward_bytes = cp.comm_bytes["send_recv"]
    out.backward(grad)
    return dict(
        output=(out - mine(expected)).abs().max().item(),
        lse=(lse - mine(expected_lse)).abs().max().item(),
        grads=[(a.grad - mine(b.grad)).abs().max().item() for a, b in zip(local, full)],
        blocks=dict(cp.blocks_computed), forward_bytes=forward_bytes,
        backward_bytes=cp.comm_bytes["send_recv"] - forward_bytes, saved=meter.peak)


@pytest.mark.parametrize("kernels", ["FUSED", "EXPLICIT"])
@pytest.mark.parametrize("n,kv_heads", [(2, H), (3, H), (4, H), (3, 1)], ids=["2", "3", "4", "3-gqa"])
def test_ring_attention_matches_full_causal_attention(n, kv_heads, kernels):
    seq_len = 4 * n
    results = run_on_ranks(n, ring_worker, seq_len, kv_heads, kernels)
    # Bytes of this rank's K (or V): with grouped-query attention the ring carries the key/value heads
    # only, kv_heads / H of multi-head attention's traffic.
    local_kv = B * kv_heads * (seq_len // n) * D * 8
    for r in results:
        assert r["output"] < 1e-13 and r["lse"] < 1e-13 and max(r["grads"]) < 1e-13
        # Zigzag balance: every rank computes the same 2N + 1 blocks, forward and backward.
        assert r["blocks"] == {"forward": 2 * n + 1, "backward": 2 * n + 1}
        # K and V make N - 1 hops forward; backward they go round again (N - 1 hops) and their
        # gradient accumulators make N hops, the last one home.
        assert r["forward_bytes"] == (n - 1) * 2 * local_kv
        assert r["backward_bytes"] == (n - 1) * 2 * local_kv + n * 2 * local_kv


def mixed_precision_worker(seq_len, kernels):
    """Ring attention in float32 and in bfloat16 from the same bfloat16-representable inputs, against full
    causal attention in float32: the largest error relative to the largest reference value (output, dQ,
    dK, dV), the dtypes returned and the bytes sent."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, seq_len, D, generator=g).bfloat16() for _ in range(4))
    full = [t.float().requires_grad_() for t in (q, k, v)]
    expected, _ = full_causal_attention(*full)
    expected.backward(grad.float())
    mine = lambda t: cp.shard_sequence(t, n, rank, dim=2)  # noqa: E731
    relative = lambda a, b: ((a.float() - mine(b)).abs().max() / mine(b).abs().max()).item()  # noqa: E731
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        local = [mine(t.to(dtype)).requires_grad_() for t in (q, k, v)]
        cp.comm_bytes.clear()
        out, lse = cp.ring_attention(*local, None, kernels=getattr(cp, kernels))
        forward_bytes = cp.comm_bytes["send_recv"]
        out.backward(mine(grad.to(dtype)))
        results[dtype] = dict(
            error=max(relative(out, expected), *(relative(a.grad, b.grad) for a, b in zip(local, full))),
            dtypes=(out.dtype, lse.dtype, *(a.grad.dtype for a in local)),
            forward_bytes=forward_bytes, backward_bytes=cp.comm_bytes["send_recv"] - forward_bytes)
    return results


@pytest.mark.parametrize("kernels", ["FUSED", "FUSED_IN_FLOAT32", "EXPLICIT"])
def test_ring_attention_in_bfloat16_sends_half_the_bytes_and_stays_within_its_rounding(kernels):
    for r in run_on_ranks(2, mixed_precision_worker, 32, kernels):
        fp32, bf16 = r[torch.float32], r[torch.bfloat16]
        # The output and gradients come back in the inputs' dtype, the log-sum-exp in float32.
        assert bf16["dtypes"] == (torch.bfloat16, torch.float32, *[torch.bfloat16] * 3)
        assert fp32["dtypes"] == (torch.float32,) * 5
        # K, V and the dK/dV accumulators travel in bfloat16: exactly half of float32's bytes.
        assert bf16["forward_bytes"] * 2 == fp32["forward_bytes"] > 0
        assert bf16["backward_bytes"] * 2 == fp32["backward_bytes"] > 0
        # float32 blocks: only float32's rounding. bfloat16 (8 significant bits, each rounding off by
        # at most 2^-8 relative): the fused kernel's probabilities before P·V, each block's output, the
        # accumulators at each of the 2 hops and the final cast are each rounded once, while the merge
        # and the local sums are float32: a few roundings, 4 x 2^-8 = 1.6e-2 of the largest value
        # (measured: 5e-3 with either blocks, as PyTorch's bfloat16 SDPA of a whole sequence is off).
        assert fp32["error"] < 1e-5
        assert bf16["error"] < 4 * 2**-8


@pytest.mark.parametrize("kernels,dtype", [("CUDA_FLASH", torch.bfloat16), ("CUDA_FLASH", torch.float16),
                                           ("CUDA_EFFICIENT", torch.bfloat16), ("CUDA_EFFICIENT", torch.float32)])
def test_cuda_kernels_shapes_on_the_meta_device(kernels, dtype):
    """The CUDA kernels' wrappers through the operators' shape rules (meta tensors need no GPU): the
    merge gets (batch, heads, queries) float32 log-sum-exps, backward the inputs' shapes and dtype; for a
    boolean mask too."""
    forward, backward = getattr(cp, kernels)
    b, h, n, d = 2, 4, 37, 8  # 37 queries: not a multiple of the memory-efficient kernel's 32-row tiles
    q, k, v, grad = (torch.empty(b, h, n, d, device="meta", dtype=dtype) for _ in range(4))
    within_documents = torch.ones(b, 1, n, n, dtype=torch.bool, device="meta")  # flash hands these to efficient
    for mask in (True, False, within_documents):
        try:
            out, lse = forward(q, k, v, mask)
            grads = backward(grad, q, k, v, out, lse, mask)
        except NotImplementedError as e:  # an operator without a meta kernel in this PyTorch
            pytest.skip(f"no meta kernel: {e}")
        assert (out.shape, out.dtype) == (q.shape, dtype)
        assert (lse.shape, lse.dtype) == ((b, h, n), torch.float32)
        assert [(t.shape, t.dtype) for t in grads] == [(q.shape, dtype)] * 3


def test_memory_efficient_backward_gets_the_log_sum_exp_its_forward_lays_out():
    """The merged log-sum-exp given to the memory-efficient backward has the shape its own forward
    returns (rows padded to 32 queries on CUDA) and is contiguous."""
    q = torch.empty(2, 4, 37, 8, device="meta", dtype=torch.float32)
    try:
        kernel_lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True)[1]
    except NotImplementedError as e:
        pytest.skip(f"no meta kernel: {e}")
    given = cp._lse_for_backward(torch.zeros(2, 4, 37), cp._EFFICIENT_LSE_TILE)
    assert given.shape == kernel_lse.shape and given.is_contiguous()


def test_kernels_chosen_by_device_and_dtype():
    """CPUs: the fused kernel, half precision widened to float32 for it. Elsewhere (here the meta device
    stands for one with no fused kernels): the written-out blocks; CUDA's choice is checked in test_cuda.py."""
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        expected = cp.FUSED_IN_FLOAT32 if dtype == torch.bfloat16 else cp.FUSED
        assert cp.default_kernels(torch.device("cpu"), dtype, 8) is expected
        assert cp.default_kernels(torch.device("meta"), dtype, 8) is cp.EXPLICIT


def saved_by_attention(seq_len):
    """Bytes ring attention saves for backward on a one-rank ring (the single device) and on this rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for r in range(n):  # every rank must take part in creating every group
        group = dist.new_group([r])
        if r == rank:
            alone = group
    q, k, v = (torch.randn(B, H, seq_len, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    meters = []
    for group, shard in [(alone, lambda t: t), (None, lambda t: cp.shard_sequence(t, n, rank, dim=2))]:
        meter = ActivationMeter()
        with meter:
            out, _ = cp.ring_attention(*(shard(t.detach()).requires_grad_() for t in (q, k, v)), group)
        meters.append(meter.peak)
    return meters


def test_attention_activation_memory_is_one_over_cp():
    for single, sharded in run_on_ranks(4, saved_by_attention, 16):
        assert sharded * 4 == single  # q, k, v, output and log-sum-exp: all 1/cp of the sequence


def test_zigzag_sharding_round_trips():
    x = torch.arange(2 * 16).view(2, 16)
    shards = [cp.shard_sequence(x, 4, r) for r in range(4)]
    assert shards[0][0].tolist() == [0, 1, 14, 15] and shards[3][0].tolist() == [6, 7, 8, 9]
    assert torch.equal(cp.restore_order(shards), x)
    with pytest.raises(ValueError, match="does not divide into 2 x 4"):
        cp.zigzag_positions(12, 4, 0)


def mode_worker(mode, heads, kv_heads, seq_len):
    """One of the other two ways against full causal attention in float64: largest differences, bytes sent
    per kind, and what the attention kept for backward (the meter's count)."""
    full, expected, _, local, mine, grad = attention_inputs(seq_len, heads, kv_heads)
    cp.comm_bytes.clear()
    meter = ActivationMeter()
    with meter:
        out, _ = cp.MODES[mode](*local, None)
    forward_bytes = dict(cp.comm_bytes)
    out.backward(grad)
    worst = max([(out - mine(expected)).abs().max().item()] +
                [(a.grad - mine(b.grad)).abs().max().item() for a, b in zip(local, full)])
    return dict(worst=worst, forward=forward_bytes, total=dict(cp.comm_bytes), saved=meter.peak)


@pytest.mark.parametrize("mode", ["allgather", "alltoall"])
@pytest.mark.parametrize("n,kv_heads", [(2, 4), (4, 4), (2, 2), (4, 1)], ids=["2", "4", "2-gqa", "4-gqa"])
def test_the_other_ways_match_full_causal_attention_with_their_traffic(mode, n, kv_heads):
    """All-gather and all-to-all against full causal attention (output, dQ, dK, dV), with the bytes each
    sends by its formula (cp.py) and the same activations kept as ring attention (q, k, v, output, log-sum-
    exp of this rank's share)."""
    heads, seq_len = 4, 4 * n
    if mode == "alltoall" and kv_heads % n:
        with pytest.raises(RuntimeError, match="1 key/value heads do not divide"):  # (a rank's ValueError)
            run_on_ranks(n, mode_worker, mode, heads, kv_heads, seq_len)
        return
    q_bytes, kv_bytes = (B * h * (seq_len // n) * D * 8 for h in (heads, kv_heads))
    for r in run_on_ranks(n, mode_worker, mode, heads, kv_heads, seq_len):
        assert r["worst"] < 1e-13
        if mode == "allgather":  # K and V gathered in forward, again in backward; dK and dV reduce-scattered
            assert r["forward"] == {"all_gather": 2 * (n - 1) * kv_bytes}
            assert r["total"] == {"all_gather": 4 * (n - 1) * kv_bytes, "reduce_scatter": 2 * (n - 1) * kv_bytes}
        else:  # q, k, v out and the output back, then their gradients: (N-1)/N of each
            assert r["forward"] == {"all_to_all": (n - 1) * (2 * q_bytes + 2 * kv_bytes) // n}
            assert r["total"] == {"all_to_all": 2 * (n - 1) * (2 * q_bytes + 2 * kv_bytes) // n}
        lse_bytes = B * heads * (seq_len // n) * 8
        assert r["saved"] == 2 * q_bytes + 2 * kv_bytes + lse_bytes


# -- Packed documents --------------------------------------------------------------------------------------

def documents_from_starts(seq_len, *rows):
    """(len(rows), seq_len) document ids, each row's documents beginning at its listed indices (0 among them)."""
    begins = torch.zeros(len(rows), seq_len, dtype=torch.int64)
    for b, starts in enumerate(rows):
        begins[b, list(starts)] = 1
    return begins.cumsum(1) - 1


def packed_documents(seq_len, chunk, seed=0):
    """Three rows: one document longer than the sequence (the whole row); documents of random lengths from 1
    to 2 chunks + 1 (most boundaries inside chunks); one document per two chunks (boundaries on chunk
    boundaries) with one split just after a chunk's first token."""
    lengths = torch.randint(1, 2 * chunk + 2, (seq_len,), generator=torch.Generator().manual_seed(seed))
    random_starts = [0] + [s for s in lengths.cumsum(0).tolist() if s < seq_len]
    aligned_starts = [*range(0, seq_len, 2 * chunk), chunk + 1]
    return documents_from_starts(seq_len, [0], random_starts, aligned_starts)


def test_block_kernels_take_a_boolean_mask():
    """The written-out and the CPU flash kernels, as the ways take them within documents
    (VisibleMasks.kernels_for, the block one tile), on a block with a boolean mask in which some rows see no key,
    merged as the ring merges (that block first, from nothing, then a block every query sees whole), against
    the softmax over both written out in float64; each block's backward from the merged pair likewise. A row
    that sees no key of a block gives output 0 and the lowest log-sum-exp there (log 0 without the NaNs)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, H, 5, D, generator=g, dtype=torch.float64) for _ in range(4))
    k_seen, v_seen = (torch.randn(2, H, 3, D, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(2, 1, 5, 5, generator=g) < 0.5
    mask[0, 0, 1] = mask[1, 0, 4] = False  # rows that see nothing
    keyless = ~mask.any(-1).expand(2, H, 5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, k_seen, v_seen)]
    scores = leaves[0] @ torch.cat([leaves[3], leaves[1]], 2).transpose(-2, -1) / D ** 0.5
    scores = scores.masked_fill(~torch.cat([torch.ones(2, 1, 5, 3, dtype=torch.bool), mask], -1), float("-inf"))
    (torch.softmax(scores, -1) @ torch.cat([leaves[4], leaves[2]], 2)).backward(grad)
    expected = [torch.softmax(scores, -1) @ torch.cat([v_seen, v], 2), scores.logsumexp(-1)]
    one_tile = [(slice(0, 5), slice(0, 5), mask)]  # the whole block, one tile
    for kernels in (cp.EXPLICIT, cp.FUSED):
        forward, backward = cp.VisibleMasks.kernels_for(kernels)
        out, lse = forward(q, k, v, one_tile)
        assert not out[keyless].any() and (lse[keyless] == torch.finfo(torch.float64).min).all()
        merged = cp.merge(torch.zeros_like(out), torch.full_like(lse, float("-inf")), out, lse)
        merged = cp.merge(*merged, *kernels[0](q, k_seen, v_seen, False))
        assert max((a - b).abs().max() for a, b in zip(merged, expected)) < 1e-14
        dq, dk, dv = backward(grad, q, k, v, *merged, one_tile)
        dq_seen, dk_seen, dv_seen = kernels[1](grad, q, k_seen, v_seen, *merged, False)
        grads = [dq + dq_seen, dk, dv, dk_seen, dv_seen]
        assert max((a - b.grad).abs().max() for a, b in zip(grads, leaves)) < 1e-13


@pytest.mark.parametrize("kernels", ["FUSED", "EXPLICIT"])
def test_the_one_device_core_computes_only_what_a_query_sees_and_equals_full_attention(kernels, monkeypatch):
    """cp.py's one-device core (model.py's in training) against full attention written out, in float64, on
    random documents (one row a single document, one of documents of 1 to 9 tokens), windows of 1, 3, 8 and
    longer than the sequence, with and without sinks, multi-head and grouped: output, log-sum-exp, dQ, dK, dV
    and the sinks' gradient to 1e-12, tiles of 4 queries; model.py's causal_attention, the readable
    reference, equals it too. The tiles hold every visible pair and, with short documents or windows, far
    fewer pairs than the causal triangle (the work the benchmark measures)."""
    monkeypatch.setattr(cp.VisibleMasks, "tile", 4)
    seq_len = 24
    lengths = torch.randint(1, 10, (seq_len,), generator=torch.Generator().manual_seed(1))
    documents = documents_from_starts(seq_len, [0], [0] + [s for s in lengths.cumsum(0).tolist() if s < seq_len])
    g = torch.Generator().manual_seed(0)
    for window, with_sinks, kv_heads in [(None, False, 4), (1, True, 2), (3, False, 1), (8, True, 4),
                                         (100, True, 2), (None, True, 1)]:
        q, grad = (torch.randn(2, 4, seq_len, D, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, kv_heads, seq_len, D, generator=g, dtype=torch.float64) for _ in range(2))
        sinks = torch.randn(4, generator=g, dtype=torch.float64) if with_sinks else None
        for given in (None, documents):
            leaves = [[t.clone().requires_grad_() for t in (q, k, v, *[sinks][:with_sinks])] for _ in range(3)]
            expected = full_causal_attention(*leaves[0][:3], given, window, *leaves[0][3:])
            out = cp.one_device_attention(*leaves[1][:3], kernels=getattr(cp, kernels), documents=given,
                                          window=window, sinks=leaves[1][3] if with_sinks else None)
            reference = model.causal_attention(*leaves[2][:3], given, window, leaves[2][3] if with_sinks else None)
            assert (out[1] - expected[1]).abs().max() < 1e-12
            for result in (out[0], reference):
                result.backward(grad)
                assert (result - expected[0]).abs().max() < 1e-12
            expected[0].backward(grad)
            for mine, reference_leaves in [(leaves[1], leaves[0]), (leaves[2], leaves[0])]:
                assert max((a.grad - b.grad).abs().max() for a, b in zip(mine, reference_leaves)) < 1e-12
    masks = cp.attention_masks(documents, 3, device=documents.device)
    tiles = masks.mask(slice(0, seq_len), slice(0, seq_len))
    seen = document_mask(documents, 3)[:, 0]
    pairs = sum((rows.stop - rows.start) * (columns.stop - columns.start) for rows, columns, _ in tiles)
    covered = torch.zeros_like(seen)
    for rows, columns, mask in tiles:  # each tile masked as its pairs are seen, and every visible pair in one
        covered[:, rows, columns] = True
        tile_seen = seen[:, rows, columns]
        every = torch.ones_like(tile_seen[0])
        given = mask[:, 0] if isinstance(mask, torch.Tensor) else every.tril() if mask else every  # True: causal
        assert torch.equal(given.expand_as(tile_seen), tile_seen)
    assert not (seen & ~covered).any() and pairs < seq_len * (seq_len + 1) // 2 // 2


def document_worker(mode, heads, kv_heads, seq_len, documents, windows=(None,), with_sinks=False, tile=None):
    """One way with documents (and each of the windows; with_sinks: and sinks) against full attention within
    them (output, dQ, dK, dV, the sinks' gradient summed over the ranks), by each kernel: the largest
    differences; and the output through ContextParallelCore (as model.py calls it) equals the call's. tile:
    queries per tile (VisibleMasks.tile), small to cut the blocks into several."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if tile:
        cp.VisibleMasks.tile = tile
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(len(documents), heads, seq_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(len(documents), kv_heads, seq_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(heads, generator=g, dtype=torch.float64) if with_sinks else None
    mine = lambda t: cp.shard_sequence(t, n, rank, dim=2)  # noqa: E731
    worst = {}
    for window in windows:
        full = [t.clone().requires_grad_() for t in (q, k, v, *[sinks][:with_sinks])]
        expected, _ = full_causal_attention(*full[:3], documents, window, *full[3:])
        expected.backward(grad)
        for kernels in ("FUSED", "EXPLICIT"):
            local = [mine(t).requires_grad_() for t in (q, k, v)]
            local += [sinks.clone().requires_grad_()] if with_sinks else []
            options = dict(documents=documents, window=window, sinks=local[3] if with_sinks else None)
            out, _ = cp.MODES[mode](*local[:3], None, kernels=getattr(cp, kernels), **options)
            out.backward(mine(grad))
            differences = [(out - mine(expected)).abs().max().item()]
            differences += [(a.grad - mine(b.grad)).abs().max().item() for a, b in zip(local[:3], full)]
            if with_sinks:
                dist.all_reduce(local[3].grad)
                differences.append((local[3].grad - full[3].grad).abs().max().item())
            worst[f"{kernels} window {window}"] = max(differences)
            if kernels == "FUSED":  # the default kernels on CPU
                assert torch.equal(cp.ContextParallelCore(None, mode)(*local[:3], **options), out)
    return worst


@pytest.mark.parametrize("mode", ["ring", "allgather", "alltoall"])
@pytest.mark.parametrize("n,heads,kv_heads", [(2, 4, 4), (4, 4, 4), (2, 8, 2), (4, 8, 4)],
                         ids=["2", "4", "2-gqa", "4-gqa"])
def test_each_way_matches_full_attention_within_documents(mode, n, heads, kv_heads):
    """Documents shorter than a chunk, longer than the sequence, ending on chunk boundaries and inside chunks,
    different in each row: each way equals full attention within them, by the fused and the written-out
    kernels, in float64."""
    chunk = 3
    seq_len = 2 * n * chunk
    for worst in run_on_ranks(n, document_worker, mode, heads, kv_heads, seq_len, packed_documents(seq_len, chunk)):
        assert max(worst.values()) < 1e-13


@pytest.mark.parametrize("mode", ["ring", "allgather", "alltoall"])
@pytest.mark.parametrize("n,heads,kv_heads", [(2, 8, 2), (4, 4, 4)], ids=["2-gqa", "4"])
def test_each_way_matches_full_attention_within_windows_and_with_sinks(mode, n, heads, kv_heads):
    """The same documents, and within them windows of 1 token (a query sees itself alone), 4 (across every
    chunk boundary, shorter than some documents) and longer than the sequence, and a sink on every head, the
    blocks cut into tiles of 2 queries: each way equals full attention, its sinks' gradient too, in float64."""
    chunk = 3
    seq_len = 2 * n * chunk
    windows = (1, 4, 2 * seq_len)
    for worst in run_on_ranks(n, document_worker, mode, heads, kv_heads, seq_len, packed_documents(seq_len, chunk),
                              windows, True, 2):
        assert max(worst.values()) < 1e-13, worst


def ring_traffic_worker(seq_len, documents, kernels, window=None):
    """Ring attention without and with documents (and the window): blocks computed, bytes sent forward and
    backward, and the largest difference from full attention within the documents (and the window)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(len(documents), H, seq_len, D, generator=g, dtype=torch.float64) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = full_causal_attention(*full, documents, window)
    expected.backward(grad)
    mine = lambda t: cp.shard_sequence(t, n, rank, dim=2)  # noqa: E731
    results = {}
    for given in (None, documents):
        local = [mine(t).requires_grad_() for t in (q, k, v)]
        cp.comm_bytes.clear(), cp.blocks_computed.clear()
        out, _ = cp.ring_attention(*local, None, kernels=getattr(cp, kernels), documents=given,
                                   window=None if given is None else window)
        forward_bytes = cp.comm_bytes["send_recv"]
        out.backward(mine(grad))
        results["documents" if given is not None else "causal"] = dict(
            blocks=dict(cp.blocks_computed), forward_bytes=forward_bytes,
            backward_bytes=cp.comm_bytes["send_recv"] - forward_bytes,
            worst=max([(out - mine(expected)).abs().max().item()] +
                      [(a.grad - mine(b.grad)).abs().max().item() for a, b in zip(local, full)]))
    return results


def ring_skips(documents, n, window=None):
    """Per rank, from the ids alone: the empty blocks (pairs of a query chunk of this rank and a key chunk at or
    before it where no query sees a key in any row), and the K/V sends and dK/dV sends left if a K/V block goes
    round only as far as the furthest rank that needs it and its gradients come home from there in one
    message (plain causal attention: N-1 and N); and how far each block goes."""
    chunk = documents.shape[1] // (2 * n)
    seen = document_mask(documents, window)[:, 0].unflatten(1, (2 * n, chunk)).unflatten(3, (2 * n, chunk))
    seen = seen.any(dim=(0, 2, 4))
    chunks = lambda r: (r, 2 * n - 1 - r)  # noqa: E731
    needs = [[any(seen[qc, kc] for qc in chunks(r) for kc in chunks(j)) for j in range(n)] for r in range(n)]
    reach = [max(t for t in range(n) if needs[(j + t) % n][j]) for j in range(n)]
    sends = []
    for r in range(n):
        goes = [reach[(r - step) % n] for step in range(n)]  # how far the block rank r holds at each step goes
        sends.append(dict(
            empty_blocks=sum(1 for j in range(n) for qc in chunks(r) for kc in chunks(j)
                             if kc <= qc and not seen[qc, kc]),
            kv=sum(1 for step in range(n - 1) if step < goes[step]),  # on to the next rank
            grad=sum(1 for step in range(n) if 0 < goes[step] and step <= goes[step])))  # on, or home from the last
    return sends, reach


@pytest.mark.parametrize("kernels", ["FUSED", "EXPLICIT"])
@pytest.mark.parametrize("n", [2, 4])
def test_ring_skips_the_blocks_and_messages_no_query_needs(n, kernels):
    """Documents that leave blocks empty in every row: ring attention computes fewer blocks by exactly the
    empty ones and sends fewer bytes by exactly the messages no rank needs, never more, and still equals
    full attention within the documents. On 4 ranks one block goes one hop (its gradients come home from
    two ranks on, in one message) and one round the whole ring through ranks that only relay it."""
    chunk = 3
    seq_len = 2 * n * chunk
    if n == 2:  # rank 1 sees rank 0's block (a document across chunks 0 and 1); rank 0 sees no other block
        documents = documents_from_starts(seq_len, [0, 2, 6, 9, 10], [0, 3, 4, 6, 7, 9])
    else:  # rank 2 sees rank 1's block (chunks 1 and 2), rank 1 rank 2's (chunks 5 and 6)
        documents = documents_from_starts(seq_len, [0, 1, 3, 9, 12, 15, 18, 21], [0, 3, 6, 9, 12, 15, 16, 21, 22])
    assert ring_skips(documents, n)[1] == {2: [1, 0], 4: [0, 1, 3, 0]}[n]
    assert_ring_skips(documents, n, kernels)


def test_the_ring_sends_a_block_only_as_far_as_a_window_reaches():
    """One document a row and a window of 2 tokens on 4 ranks (chunks of 3, rank r holding chunks r and 7-r):
    a query sees at most the chunk before its own. Rank 0's block (chunks 0 and 7) is needed by rank 1
    alone (chunk 1), one hop on; every other block by the rank behind it (rank r-1's late chunk 8-r sees
    chunk 7-r), three hops round, so no K/V message is saved; but only the blocks a query sees are computed
    (3 or 4 of each rank's 9), and rank 0's gradients come home from rank 1 in one message."""
    n, seq_len = 4, 24
    documents = torch.zeros(2, seq_len, dtype=torch.int64)
    assert ring_skips(documents, n, window=2)[1] == [1, 3, 3, 3]
    assert_ring_skips(documents, n, "FUSED", window=2)


def assert_ring_skips(documents, n, kernels, window=None):
    """Ring attention within documents (and a window) computes fewer blocks than causal attention by exactly
    the empty ones, sends fewer bytes by exactly the messages no rank needs, and equals full attention."""
    seq_len = documents.shape[1]
    sends, _ = ring_skips(documents, n, window)
    local_kv = len(documents) * H * (seq_len // n) * D * 8  # bytes of one rank's K (or V)
    results = run_on_ranks(n, ring_traffic_worker, seq_len, documents, kernels, window)
    for left, r in zip(sends, results):
        causal, within = r["causal"], r["documents"]
        assert within["worst"] < 1e-13 and causal["worst"] > 0.1  # (plain causal attention is not the same)
        computed = 2 * n + 1 - left["empty_blocks"]
        assert causal["blocks"] == {"forward": 2 * n + 1, "backward": 2 * n + 1}
        assert within["blocks"] == {"forward": computed, "backward": computed}
        skipped_kv, skipped_grad = (n - 1 - left["kv"]) * 2 * local_kv, (n - left["grad"]) * 2 * local_kv
        assert within["forward_bytes"] == causal["forward_bytes"] - skipped_kv
        assert within["backward_bytes"] == causal["backward_bytes"] - skipped_kv - skipped_grad
        assert skipped_kv >= 0 and skipped_grad >= 0
    assert sum(left["empty_blocks"] for left in sends) > 0 and sum(left["kv"] for left in sends) < n * (n - 1)

ARGV = EQUIVALENCE
# Heads of any width, with QK-norm (Qwen3's attention): 12 wide over d_model 32 (q is 48), or 4 (q is 16)
WIDE_HEADS, NARROW_HEADS = ["--head-dim", "12", "--qk-norm"], ["--head-dim", "4", "--qk-norm"]


@pytest.mark.parametrize("mode", ["ring", "allgather", "alltoall"])
@pytest.mark.parametrize("world,flags,model", [(2, ["--cp", "2"], []), (4, ["--cp", "4"], []),
                                               (4, ["--cp", "2"], ["--arch", "llama", *WIDE_HEADS])],
                         ids=["cp2", "cp4", "cp2-dp2-wide-heads-qk-norm"])
def test_context_parallel_matches_single_device(tmp_path, world, flags, model, mode):
    argv = [*ARGV, *model, *flags, "--cp-mode", mode]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)]):
        assert_matches_oracle(result, oracle([*ARGV, *model]))
    assert_matches_plan(tmp_path, argv, world)


@pytest.mark.full
@pytest.mark.parametrize("mode", ["allgather", "alltoall"])
@pytest.mark.parametrize("flags,model", [
    # rotary, split heads (wide, with QK-norm: its weights' gradients summed over tp), sequence shards
    (["--tp", "2", "--sp"], ["--arch", "llama", "--kv-heads", "4", *WIDE_HEADS]),
    (["--pp", "2", "--recompute", "selective"], ["--layers", "4", *NARROW_HEADS]),  # the core run again in backward
    (["--ep", "2", "--zero", "1", "--recompute", "full"], ["--arch", "llama", "--kv-heads", "2", "--experts", "4"]),
    (["--zero", "3"], ["--arch", "llama", "--kv-heads", "2", *WIDE_HEADS])],
    ids=["tp2-sp-llama-wide-heads", "pp2-selective-narrow-heads", "ep2-zero1-full-moe", "zero3-gqa-wide-heads"])
def test_the_other_ways_compose_as_ring_attention_does(tmp_path, mode, flags, model):
    """cp=2 with each other dimension, grouped-query attention, rotary positions, recomputation, and heads of
    another width than d_model / heads with QK-norm, on 4 ranks: the single device's training, and the memory
    and traffic tools/plan/ predicts."""
    argv = [*ARGV, *model, "--cp", "2", "--cp-mode", mode, *flags]
    for result in run_on_ranks(4, train_worker, [*argv, "--out", str(tmp_path)], timeout=180):
        assert_matches_oracle(result, oracle([*ARGV, *model]))
    assert_matches_plan(tmp_path, argv, 4)


def test_ring_attention_under_windows_trains_as_one_device_and_sends_what_the_planner_counts(tmp_path):
    """A window of 5 tokens on every second layer and a sink on every head, cp 4 (chunks of 4): the ring
    trains as one device does, and each rank sends exactly the bytes tools/plan/ counts for it from cp.py's
    plan (ring_messages), which differ from rank to rank (rank 0's block goes one hop, the others' round the
    ring, and a block's accumulators come home from the last rank that needed it): none more than without
    the window, some less."""
    argv = [*ARGV, "--arch", "llama", "--seq-len", "32", "--sliding-window", "5", "--window-layers", "1:1",
            "--attention-sinks", "--cp", "4"]
    for result in run_on_ranks(4, train_worker, [*argv, "--out", str(tmp_path)]):
        assert_matches_oracle(result, oracle(argv[:-2]))
    assert_matches_plan(tmp_path, argv, 4)
    sent = plan.predict(cli.parse_args(argv), 4)["comm_cp_send_recv_bytes"]
    without = plan.predict(cli.parse_args([*argv[:-7], "--cp", "4"]), 4)["comm_cp_send_recv_bytes"]
    assert all(s <= w for s, w in zip(sent, without)) and sum(sent) < sum(without) and len(set(sent)) > 1


def test_all_to_all_needs_whole_heads_on_each_rank():
    with pytest.raises(cli.ConfigError, match="--cp-mode alltoall gives each of --cp 4 ranks whole heads: 4 query "
                                              "and 2 key/value heads a tensor-parallel rank do not divide by 4"):
        cli.check_args(cli.parse_args([*ARGV, "--cp", "4", "--cp-mode", "alltoall", "--arch", "llama"]), 4)
    with pytest.raises(cli.ConfigError, match="2 query and 1 key/value heads a tensor-parallel rank"):
        cli.check_args(cli.parse_args([*ARGV, "--cp", "2", "--tp", "2", "--cp-mode", "alltoall", "--arch", "llama"]), 4)


def test_sequence_length_must_split_into_two_chunks_per_rank():
    with pytest.raises(cli.ConfigError, match="--seq-len 12 must divide into 2 x 4 chunks"):
        cli.check_args(cli.parse_args([*ARGV, "--cp", "4", "--seq-len", "12"]), 4)


def test_self_check_runs_alone_in_an_empty_folder(tmp_path):
    # ring: fused and explicit, multi-head and GQA; the others; each again within packed documents, and within
    # them, a window and with sinks
    differences = self_check_alone("cp.py", 4, tmp_path)
    assert len(differences) == 18 and max(differences) < 1e-12


def test_the_layers_of_a_micro_batch_share_one_host_copy_of_its_document_ids(monkeypatch):
    """Every layer asks for the masks with the same ids tensor: they go to the host once (on a GPU each copy
    makes the host wait), and new ids, even equal ones, get masks of their own."""
    copies = []
    to_host = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies.append(t) or to_host(t, *a, **k))
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]])
    first = cp.attention_masks(ids)
    assert all(cp.attention_masks(ids) is first for _ in range(3)) and len(copies) == 1
    again = cp.attention_masks(ids.clone())
    assert again is not first and len(copies) == 2
    tiles, tiles_again = (masks.mask(slice(0, 8), slice(0, 8)) for masks in (first, again))
    assert [t[:2] for t in tiles] == [t[:2] for t in tiles_again] and torch.equal(tiles[0][2], tiles_again[0][2])
