"""Data parallelism equals the single device, step for step, in float64."""
import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from distributed import run_on_ranks, self_check_alone
from dp import DataParallel, ReplicatedOptimizer, clip_grad_norm_
from oracle import assert_matches_oracle, oracle, train_worker

# Clipping at 0.05 is active at every step of this run (checked below).
TINY = ["--model", "tiny", "--steps", "4", "--batch-size", "8", "--lr", "1e-2", "--warmup", "2",
        "--grad-clip", "0.05", "--eval-interval", "1000", "--log-interval", "1000"]


@pytest.mark.parametrize("world,micro_batches", [(2, 1), (2, 2), (4, 2)])
def test_data_parallel_matches_single_device(tmp_path, world, micro_batches):
    argv = [*TINY, "--micro-batches", str(micro_batches), "--dtype", "float64", "--out", str(tmp_path),
            "--bucket-mb", "0.01"]  # several buckets, so the ordering of launches is exercised
    results = run_on_ranks(world, train_worker, argv)
    for result in results:  # every replica, not only rank 0
        assert_matches_oracle(result, oracle(argv))


def toy_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()


def bucket_worker(micro_batches):
    """Gradients of DataParallel (tiny buckets, no_sync accumulation) against the full-batch gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = toy_model()
    replica = copy.deepcopy(reference)
    dp = DataParallel(replica.parameters(), bucket_bytes=200)
    x = torch.randn(micro_batches, world, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for m in range(micro_batches):
        (reference(x[m].flatten(0, 1)).square().mean() / micro_batches).backward()
    launched_during_backward = []
    for m in range(micro_batches):
        if m < micro_batches - 1:
            with dp.no_sync():
                (replica(x[m, rank]).square().mean() / micro_batches).backward()
            assert all(b.work is None for b in dp.buckets), "no_sync must not communicate"
        else:
            (replica(x[m, rank]).square().mean() / micro_batches).backward()
            launched_during_backward = [b.work is not None for b in dp.buckets]
    dp.finish_grad_sync()
    worst = max((a.grad - b.grad).abs().max().item() for a, b in zip(reference.parameters(), replica.parameters()))
    return dict(worst=worst, n_buckets=len(dp.buckets), launched=launched_during_backward,
                comm=dp.comm_bytes["all_reduce"], n_params=sum(p.numel() for p in replica.parameters()))


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_buckets_overlap_backward_and_no_sync_accumulates(micro_batches):
    results = run_on_ranks(2, bucket_worker, micro_batches)
    for r in results:
        assert r["worst"] < 1e-15
        assert r["n_buckets"] > 2
        # Every bucket's all-reduce was launched by the hooks, before backward returned.
        assert all(r["launched"])
        # Ring all-reduce: each rank sends 2 (N-1)/N of the gradient bytes (N = 2: exactly once).
        assert r["comm"] == r["n_params"] * 8


def unused_parameter_worker():
    """A parameter that gets a gradient on one rank only still averages correctly, and nothing hangs."""
    rank = dist.get_rank()
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    dp = DataParallel([a, b], bucket_bytes=1)  # one bucket per parameter
    loss = (a * 2).sum() + ((b * 4).sum() if rank == 0 else 0)
    loss.backward()
    dp.finish_grad_sync()
    return a.grad.tolist(), b.grad.tolist()


def test_parameter_unused_on_one_rank():
    for grad_a, grad_b in run_on_ranks(2, unused_parameter_worker):
        assert grad_a == [2.0] * 3
        assert grad_b == [2.0] * 3  # (4 + 0) / 2


def unused_everywhere_worker():
    """find_unused_parameters: c is used by no rank (its gradient stays None, as in one process), b by rank 0
    only (averaged); and a collective on the same group between backward() and finish_grad_sync() is fine,
    as the buckets backward left incomplete were launched when it ended."""
    rank = dist.get_rank()
    a, b, c = (torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(3))
    dp = DataParallel([a, b, c], bucket_bytes=1, find_unused_parameters=True)  # one bucket per parameter
    grads = []
    for step in range(2):
        loss = (a * 2).sum() + ((b * 4).sum() if rank == 0 else 0)
        loss.backward()
        logged = loss.detach().reshape(1).clone()
        dist.all_reduce(logged)  # a loss all-reduce for logging, before the gradients are finished
        dp.finish_grad_sync()
        grads.append([None if p.grad is None else p.grad.tolist() for p in (a, b, c)])
        for p in (a, b, c):
            p.grad = None  # zero_grad(set_to_none=True)
    return grads, logged.item(), dp.comm_bytes["all_reduce"]


def test_a_parameter_no_rank_used_keeps_no_gradient():
    for grads, logged, comm in run_on_ranks(2, unused_everywhere_worker):
        assert grads == [[[2.0] * 3, [2.0] * 3, None]] * 2
        assert logged == 6.0 + 18.0
        # Two steps of: three one-parameter buckets of 3 float64 (padded to 4, a multiple of the group's
        # size) and the 3-byte used-mask, each all-reduced (2 (N-1)/N of the bytes: once each with N = 2).
        assert comm == 2 * (3 * 4 * 8 + 3)


def replicated_master_worker():
    """ReplicatedOptimizer over bfloat16 weights with float32 masters: filled by fill_master (with a value
    bfloat16 cannot hold), stepped with DataParallel's float32 averages, rounded back into the weights; c,
    which no rank used, keeps no gradient and is not stepped."""
    rank = dist.get_rank()
    a, b, c = (torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(3))
    dp = DataParallel([a, b, c], bucket_bytes=1, find_unused_parameters=True, reduce_dtype=torch.float32)
    filled = []

    def fill_master(name, master):
        filled.append((name, tuple(master.shape)))
        master.fill_(1 + 2**-12)

    optimizer = ReplicatedOptimizer([("a", a), ("b", b), ("c", c)], lambda ps: torch.optim.SGD(ps, lr=2**-8),
                                    dp, torch.float32, fill_master)
    ((a * 2).sum() + ((b * 4).sum() if rank == 0 else 0)).backward()
    dp.finish_grad_sync()
    norm = clip_grad_norm_([optimizer], 1e9, weights={a: 0.5})  # a's squares halved, b's counted whole
    optimizer.step()
    masters = {name: master.tolist() for name, _, _, master in optimizer.pieces()}
    return (filled, norm.item(), masters, [p.tolist() for p in (a, b, c)],
            [m.dtype == torch.float32 and m is not p for m, p in zip(optimizer.param_shards, (a, b, c))])


def test_replicated_optimizer_steps_wider_masters_and_rounds_them_into_the_weights():
    stepped = 1 + 2**-12 - 2**-8 * 2  # the master minus lr times the averaged gradient, 2 for a and b
    for filled, norm, masters, weights, apart in run_on_ranks(2, replicated_master_worker):
        assert filled == [("a", (3,)), ("b", (3,)), ("c", (3,))]
        assert norm == (0.5 * 3 * 2**2 + 3 * 2**2) ** 0.5
        assert masters == {"a": [stepped] * 3, "b": [stepped] * 3, "c": [1 + 2**-12] * 3}
        rounded = torch.tensor(stepped).to(torch.bfloat16).item()
        assert weights == [[rounded] * 3, [rounded] * 3, [1.0] * 3]
        assert all(apart)


def nested_contexts_worker():
    """no_sync and keep_incomplete_buckets entered inside themselves: leaving the inner one keeps the outer."""
    a, b = (torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(2))
    dp = DataParallel([a, b], bucket_bytes=1)  # one bucket per parameter: b's first (backward order), then a's
    with dp.no_sync():
        with dp.no_sync():
            pass
        (a.sum() + b.sum()).backward()
        launched_in_no_sync = [bucket.launched for bucket in dp.buckets]
    with dp.keep_incomplete_buckets():
        with dp.keep_incomplete_buckets():
            pass
        (b * 2).sum().backward()  # completes b's bucket only; a's must wait for a later backward
        launched_keeping_incomplete = [bucket.launched for bucket in dp.buckets]
    dp.finish_grad_sync()
    return launched_in_no_sync, launched_keeping_incomplete, a.grad.tolist(), b.grad.tolist()


def test_nested_contexts_keep_the_outer_one():
    for in_no_sync, keeping_incomplete, a_grad, b_grad in run_on_ranks(2, nested_contexts_worker):
        assert in_no_sync == [False, False]
        assert keeping_incomplete == [True, False]
        assert a_grad == [1.0] * 3 and b_grad == [3.0] * 3  # accumulated over both backwards, averaged


def double_backward_worker():
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    dp = DataParallel([p])
    p.sum().backward()
    try:
        p.sum().backward()  # a second synced backward before finish_grad_sync
    except RuntimeError as e:
        return str(e)
    finally:
        dp.finish_grad_sync()
    return "no error"


def test_second_backward_without_no_sync_is_an_error():
    for message in run_on_ranks(2, double_backward_worker):
        assert "no_sync" in message


def test_self_check_covers_every_stage_alone_in_an_empty_folder(tmp_path):
    differences = self_check_alone("dp.py", 4, tmp_path)  # every gradient, bucketed, ZeRO-1, 2, 3, hybrid 3
    assert len(differences) == 6 and max(differences) < 1e-12


def freed_after_use():
    """Whether a DataParallel that synchronised a backward is freed once nothing of the caller's holds it."""
    model = toy_model()
    dp = DataParallel(model.parameters())
    model(torch.ones(4, 8, dtype=torch.float64)).sum().backward()
    dp.finish_grad_sync()
    alive = weakref.ref(dp)
    del dp
    gc.collect()
    return alive() is None


def test_a_data_parallel_no_longer_used_is_freed_with_its_hold_on_the_group():
    """The parameters keep their gradient hooks, and autograd keeps the parameters where the garbage
    collector cannot look: hooks holding the DataParallel would keep it, and through it the process group
    and gloo's threads, alive past destroy_process_group (the cause of aborts at the exit of dp.py)."""
    assert run_on_ranks(2, freed_after_use) == [True, True]
