"""Context parallelism: ring attention equals full causal attention; training equals the single device."""

import pytest
import torch
import torch.distributed as dist

import cli
import cp
from distributed import run_on_ranks, self_check_alone
from meter import ActivationMeter
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker

B, H, D = 2, 3, 8  # batch, heads, head_dim of the unit tests


def full_causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v and its log-sum-exp, written out; k and v may have fewer
    heads than q, each serving consecutive query heads (grouped-query attention)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / D ** 0.5
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def ring_worker(seq_len, kv_heads, kernels):
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(B, H, seq_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, seq_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, expected_lse = full_causal_attention(*full)
    expected.backward(grad)
    local = [cp.shard_sequence(t, n, rank, dim=2).requires_grad_() for t in (q, k, v)]
    cp.comm_bytes.clear(), cp.blocks_computed.clear()
    meter = ActivationMeter()
    with meter:
        out, lse = cp.ring_attention(*local, None, getattr(cp, kernels))
    forward_bytes = cp.comm_bytes["send_recv"]
    out.backward(cp.shard_sequence(grad, n, rank, dim=2))
    mine = lambda t: cp.shard_sequence(t, n, rank, dim=2)  # noqa: E731
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


ARGV = EQUIVALENCE


@pytest.mark.parametrize("world,flags", [(2, ["--cp", "2"]), (4, ["--cp", "4"]), (4, ["--cp", "2"])],
                         ids=["cp2", "cp4", "cp2-dp2"])
def test_context_parallel_matches_single_device(tmp_path, world, flags):
    for result in run_on_ranks(world, train_worker, [*ARGV, *flags, "--out", str(tmp_path)]):
        assert_matches_oracle(result, oracle(ARGV))


def test_sequence_length_must_split_into_two_chunks_per_rank():
    with pytest.raises(cli.ConfigError, match="--seq-len 12 must divide into 2 x 4 chunks"):
        cli.check_args(cli.parse_args([*ARGV, "--cp", "4", "--seq-len", "12"]), 4)


def test_self_check_runs_alone_in_an_empty_folder(tmp_path):
    differences = self_check_alone("cp.py", 4, tmp_path)  # fused and explicit blocks; multi-head and GQA
    assert len(differences) == 4 and max(differences) < 1e-12
