"""Pipeline parallelism: every schedule equals the single device; schedules are valid; memory and traffic."""
import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from training import cli
import pp
from distributed import run_on_ranks, self_check_alone
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan

# 8 layers, so that 4 stages x 2 virtual stages each hold one; two steps; 24 sequences, so that 2, 3, 4, 6
# and 8 micro-batches divide them.
BATCH = 24
BASE = [*EQUIVALENCE, "--layers", "8", "--steps", "2", "--batch-size", str(BATCH)]



def read_log(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").open()]


CASES = [(stages, schedule, 2 if schedule == "interleaved" else 1, micro) for stages in (2, 4)
         for schedule in ("gpipe", "1f1b", "interleaved", "zb1") for micro in (stages, 2 * stages)]  # m = p, m > p
# Three stages and three virtual stages: the 8 layers split unevenly (3+3+2, 2+2+1+1+1+1).
CASES += [(3, "gpipe", 1, 3), (3, "1f1b", 1, 6), (3, "interleaved", 2, 6), (2, "interleaved", 3, 4), (3, "zb1", 1, 6)]
# ZB-V: two chunks a rank in a V, on 2, 3 and 4 stages, m = p and 2p (3 stages: 6 chunks of 2+2+1+1+1+1 layers).
CASES += [(stages, "zbv", 2, micro) for stages in (2, 3, 4) for micro in (stages, 2 * stages)]


def v_model_chunks(stages, rank):
    """ZB-V's placement, written out: rank r holds model chunks r (down the V) and 2P-1-r (back up)."""
    return [rank, 2 * stages - 1 - rank]


def p2p_sends(schedule, stages, chunks, micro, rank):
    """Messages a rank sends in a step: an activation and a gradient per micro-batch and chunk boundary, but
    the last model chunk sends no activation, the first no gradient; under ZB-V rank r's chunks are r and
    2P-1-r (rank 0: the first and the last), and the turn of the V (chunks P-1 and P, both on rank P-1)
    sends nothing."""
    if schedule == "zbv":
        return 2 * micro * ((rank < stages - 1) + (rank > 0))
    return micro * (chunks - (rank == stages - 1)) + micro * (chunks - (rank == 0))


def in_flight(actions):
    """The most micro-batches whose activations an action list keeps at once: from a forward to the pass
    that sums the weights' gradients (the backward, or ZB-H1's weight pass)."""
    summing = "weight" if any(kind == "weight" for kind, _, _ in actions) else "backward"
    live = peak = 0
    for kind, _, _ in actions:
        live += (kind == "forward") - (kind == summing)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stages,schedule,chunks,micro", CASES, ids=lambda v: str(v))
def test_pipeline_matches_single_device(tmp_path, stages, schedule, chunks, micro):
    argv = [*BASE, "--micro-batches", str(micro), "--pp", str(stages), "--schedule", schedule,
            "--virtual-stages", str(chunks), "--out", str(tmp_path)]
    results = run_on_ranks(stages, train_worker, argv, timeout=180)
    for result in results:  # every stage reports the full losses and the merged state dict
        assert_matches_oracle(result, oracle([*BASE, "--micro-batches", str(micro)]))

    micro_bytes = (BATCH // micro) * 16 * 32 * 8  # one micro-batch's activations: b * s * h float64 values
    for entry in read_log(tmp_path / f"gpu{stages}_tp1_pp{stages}_cp1_ep1"):
        for rank in range(stages):
            # Point-to-point: b*s*h per micro-batch and chunk boundary, each way.
            sends = p2p_sends(schedule, stages, chunks, micro, rank)
            assert entry["comm_pp_send_recv_bytes"][rank] == sends * micro_bytes
            # Micro-batches whose activations are alive at once.
            peak = entry["pp_peak_in_flight"][rank]
            if schedule == "gpipe":
                assert peak == micro
            elif schedule == "1f1b":
                assert peak == min(stages - rank, micro) <= stages
            elif schedule == "zb1":  # W deferred: more on later stages, never more than 1F1B's first stage
                assert peak == in_flight(pp.make_schedule("zb1", micro, stages, rank)) <= min(stages, micro)
            elif schedule == "zbv":  # chunks of half a stage: at most 1F1B's first stage's P micro-batches
                assert peak == in_flight(pp.make_schedule("zbv", micro, stages, rank, 2)) <= 2 * min(stages, micro)
            assert 0 <= entry["pp_bubble"][rank] <= 1
        work = {"zb1": 3 * micro, "zbv": 6 * micro}.get(schedule, chunks * micro)  # F, B and W of a unit each
        if schedule != "zbv" or micro >= 2 * stages - 1:  # (fewer leave ZB-V's warm-up gaps: see the timeline)
            assert entry["pp_bubble_formula"] == pytest.approx((stages - 1) / (work + stages - 1))
    # The last step's timeline: every rank's actions in its schedule's order, each waiting, then computing,
    # one after the other.
    for rank, actions in enumerate(entry["pp_timeline"]):
        assert [tuple(a[:3]) for a in actions] == pp.make_schedule(schedule, micro, stages, rank, chunks)
        times = [t for a in actions for t in a[3:]]
        assert times == sorted(times) and times[0] >= 0


def test_pipeline_with_data_parallel(tmp_path):
    argv = [*BASE, "--micro-batches", "2", "--pp", "2", "--out", str(tmp_path)]
    for result in run_on_ranks(4, train_worker, argv, timeout=180):
        assert_matches_oracle(result, oracle([*BASE, "--micro-batches", "2"]))


@pytest.mark.parametrize("flags,model", [(["--cp", "2", "--schedule", "interleaved"], []),
                                         (["--ep", "2"], ["--experts", "4"])], ids=["cp2", "ep2"])
def test_pipeline_with_context_or_expert_parallel(tmp_path, flags, model):
    argv = [*BASE, *model, "--micro-batches", "2", "--pp", "2", *flags, "--out", str(tmp_path)]
    for result in run_on_ranks(4, train_worker, argv, timeout=180):
        assert_matches_oracle(result, oracle([*BASE, *model, "--micro-batches", "2"]))


def test_pipeline_with_tensor_and_sequence_parallel(tmp_path):
    argv = [*BASE, "--micro-batches", "4", "--pp", "2", "--tp", "2", "--sp", "--out", str(tmp_path)]
    for result in run_on_ranks(4, train_worker, argv, timeout=180):
        assert_matches_oracle(result, oracle([*BASE, "--micro-batches", "4"]))


@pytest.mark.full
@pytest.mark.parametrize("schedule", ["zb1", "zbv"])
@pytest.mark.parametrize("flags,model", [
    (["--zero", "1"], []), (["--tp", "2", "--sp"], []), (["--cp", "2"], []),
    (["--ep", "2"], ["--experts", "4", "--shared-experts", "1", "--balance", "both"]),
    (["--tp", "2"], ["--arch", "llama", "--experts", "4"])], ids=["dp2-zero1", "tp2-sp", "cp2", "ep2", "tp2-moe-llama"])
def test_zero_bubble_with_other_dimensions(tmp_path, flags, model, schedule):
    """ZB-H1's and ZB-V's weight passes sum what data parallelism reduces (after the last of each chunk), run
    tp's collectives of the norms' and biases' gradients, and leave an MoE's all-to-all and the ring in B;
    ZB-V's turn of the V hands its messages over on one rank. Memory and traffic are as tools/plan/ predicts."""
    argv = [*BASE, *model, "--micro-batches", "4", "--pp", "2", "--schedule", schedule, *flags]
    for result in run_on_ranks(4, train_worker, [*argv, "--out", str(tmp_path)], timeout=180):
        assert_matches_oracle(result, oracle([*BASE, *model, "--micro-batches", "4"]))
    assert_matches_plan(tmp_path, argv, 4)


@pytest.mark.full
@pytest.mark.parametrize("stages,micro,flags,model", [
    (3, 3, ["--zero", "1"], []), (4, 4, ["--tp", "2", "--sp"], []), (3, 6, ["--cp", "2"], []),
    (4, 4, ["--ep", "2"], ["--experts", "4", "--shared-experts", "1", "--balance", "both"])],
    ids=["pp3-dp2-zero1", "pp4-tp2-sp", "pp3-cp2", "pp4-ep2"])
def test_zbv_deeper_with_other_dimensions(tmp_path, stages, micro, flags, model):
    """ZB-V on 3 and 4 stages (6 and 8 chunks in a V, 6 or 8 ranks) with each other dimension, m = p and 2p."""
    argv = [*BASE, *model, "--micro-batches", str(micro), "--pp", str(stages), "--schedule", "zbv", *flags]
    world = 2 * stages
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*BASE, *model, "--micro-batches", str(micro)]))
    assert_matches_plan(tmp_path, argv, world)


def test_weight_passes_follow_the_graph_not_memory_addresses():
    """W runs one backward per group of weights, in backward_graph's order, and the collectives inside them
    (tp's sums of a norm's gradient under sp) pair up across ranks only if that order is the graph's own on
    every rank. Two copies of one graph, alive at once at different addresses, must list their weights alike."""
    def weights_in_order(graphs):
        model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)) for _ in range(12)])
        loss = model(torch.randn(2, 4, requires_grad=True)).sum()
        graphs.append((model, loss))  # kept alive, so the second copy's nodes live elsewhere
        names = {id(p): name for name, p in model.named_parameters()}  # (the input has no name: left out)
        nodes, _ = pp.backward_graph([loss.grad_fn])
        return [names[id(n.variable)] for n in nodes if id(getattr(n, "variable", None)) in names]

    graphs = []
    first, second = weights_in_order(graphs), weights_in_order(graphs)
    assert first == second and len(first) == 48


# -- the schedules themselves, without processes ---------------------------------------

def simulate(schedule, n_micro, n_stages, n_chunks):
    """Run every rank's action list against the data dependencies; fail on a deadlock.

    A forward of model chunk k needs the forward of chunk k-1 done; a backward needs its own
    forward and the backward of chunk k+1. Sends never block, so a rank only waits for inputs.
    """
    lists = [pp.make_schedule(schedule, n_micro, n_stages, r, n_chunks) for r in range(n_stages)]
    n_model = n_stages * n_chunks
    if schedule == "zbv":
        model_chunk = lambda c, r: v_model_chunks(n_stages, r)[c]  # noqa: E731
    else:
        model_chunk = lambda c, r: c * n_stages + r  # noqa: E731
    done, position = set(), [0] * n_stages
    while any(position[r] < len(lists[r]) for r in range(n_stages)):
        progressed = False
        for r in range(n_stages):
            if position[r] == len(lists[r]):
                continue
            needs, runs = [], []  # (a paired action needs both halves' inputs before either runs)
            for kind, c, m in pp.halves(lists[r][position[r]]):
                k = model_chunk(c, r)
                needs += {"forward": [("forward", k - 1, m)] if k > 0 else [],
                          "backward": [("forward", k, m)] + ([("backward", k + 1, m)] if k < n_model - 1 else []),
                          "weight": [("backward", k, m)]}[kind]
                runs.append((kind, k, m))
            if all(need in done for need in needs):
                done.update(runs)
                position[r] += 1
                progressed = True
        assert progressed, f"{schedule} deadlocks at {position}"
    return lists


@pytest.mark.parametrize("schedule,n_chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3),
                                              ("zb1", 1), ("zbv", 2), ("combined", 1)])
@pytest.mark.parametrize("n_stages", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_schedules_run_everything_once_and_never_deadlock(schedule, n_chunks, n_stages, groups):
    n_micro = groups * n_stages
    kinds = ("forward", "backward", "weight") if schedule in ("zb1", "zbv") else ("forward", "backward")
    for rank, actions in enumerate(simulate(schedule, n_micro, n_stages, n_chunks)):
        expected = {(kind, c, m) for kind in kinds for c in range(n_chunks) for m in range(n_micro)}
        assert sorted(pp.every_half(actions)) == sorted(expected)
        if schedule in ("1f1b", "zb1"):  # warm-up of P-1-rank forwards before the first backward
            assert [kind for kind, _, _ in actions].index("backward") == min(n_stages - rank - 1, n_micro) + 1
        if schedule == "zb1":  # rank r holds at most r weight passes back; B and F keep 1F1B's order
            one_f_one_b = pp.make_schedule("1f1b", n_micro, n_stages, rank)
            assert [a for a in actions if a[0] != "weight"] == one_f_one_b
            held = [sum(k == "backward" for k, _, _ in actions[:i]) - sum(k == "weight" for k, _, _ in actions[:i])
                    for i in range(len(actions)) if actions[i][0] == "forward"]
            assert max(held, default=0) <= rank
        if schedule == "zbv":  # chunks of half a stage: never more than 1F1B's first stage holds, P micro-batches
            assert in_flight(actions) <= 2 * in_flight(pp.make_schedule("1f1b", n_micro, n_stages, 0))
        if schedule == "combined":  # 1F1B's order, each steady-state forward paired with the next backward;
            # 2(P - r) micro-batches in flight, twice 1F1B's (a pair's forward counted before its backward frees)
            warmup = min(2 * (n_stages - rank) - 1, n_micro)
            assert [kind for kind, _, _ in pp.every_half(actions)].index("backward") == min(warmup + 1, n_micro)
            assert in_flight(pp.every_half(actions)) == min(2 * (n_stages - rank), n_micro)
            assert all(forward[0] == "forward" and backward[0] == "backward" and forward[2] > backward[2]
                       for forward, backward in (a for a in actions if isinstance(a, pp.Paired)))


@pytest.mark.parametrize("n_stages", [2, 3, 4, 8])
def test_combined_1f1b_idles_as_1f1b(n_stages):
    """With a forward and a backward one unit each (a pair two), every rank's step takes 2(M + P - 1) units,
    1F1B's: a pair waits for nothing a neighbour computes in the same turn. Each action starts once its rank
    is free and its inputs are done; the clocks come from the schedules alone."""
    for n_micro in range(1, 3 * n_stages):
        lists = [pp.make_schedule("combined", n_micro, n_stages, r) for r in range(n_stages)]
        done, free, position = {}, [0] * n_stages, [0] * n_stages
        while any(position[r] < len(lists[r]) for r in range(n_stages)):
            for r in range(n_stages):
                if position[r] == len(lists[r]):
                    continue
                action = lists[r][position[r]]
                needs = [("forward", r - 1, m) if kind == "forward" else ("backward", r + 1, m)
                         for kind, _, m in pp.halves(action)]
                needs = [need for need in needs if 0 <= need[1] < n_stages]
                if all(need in done for need in needs):
                    start = max([free[r], *(done[need] for need in needs)])
                    free[r] = start + len(pp.halves(action))
                    done.update({(kind, r, m): free[r] for kind, _, m in pp.halves(action)})
                    position[r] += 1
        assert max(free) == 2 * (n_micro + n_stages - 1)  # so bubble_formula's (P-1) / (M+P-1) holds for it too


def paired_worker():
    """One stage, 3 micro-batches of combined 1F1B through a chunk that hands the turn over twice forward
    (pp.pass_turn, as ep.py's all-to-alls do) and twice backward: the log of who ran when."""
    log = []

    class HandOver(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, name):
            ctx.name = name
            log.append(("forward", name))
            pp.pass_turn()
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            log.append(("backward", ctx.name))
            pp.pass_turn()
            return grad, None

    chunk = lambda x: HandOver.apply(HandOver.apply(x * 2, "a"), "b")  # noqa: E731
    micro_batches = [(torch.full((2,), float(m), dtype=torch.float64, requires_grad=True), None) for m in range(3)]
    schedules = [pp.make_schedule("combined", 3, 1, 0)]
    pp.run_schedule(schedules, [chunk], micro_batches, lambda y, _: y.sum(), None, (2,), torch.float64, "cpu")
    return log, [x.grad.tolist() for x, _ in micro_batches]


def test_paired_halves_take_turns_where_they_hand_over():
    """F0, then (F1 | B0) and (F2 | B1), then B2: in each pair the backward starts, and the two alternate at
    every hand-over: the backward's "b" (the first it meets) beside the forward's "a", then its "a" beside the
    forward's "b". The gradients are unchanged (2 of each micro-batch's sum, averaged over the 3)."""
    (log, grads), = run_on_ranks(1, paired_worker, timeout=60)
    F, B = "forward", "backward"
    alone, paired = [(F, "a"), (F, "b")], [(B, "b"), (F, "a"), (B, "a"), (F, "b")]
    assert log == alone + paired + paired + [(B, "b"), (B, "a")]
    assert grads == [[2 / 3, 2 / 3]] * 3


@pytest.mark.parametrize("n_stages", [2, 3, 4, 6, 8])
def test_zbv_idles_a_sixth_of_1f1b_once_its_warm_up_is_full(n_stages):
    """On the timeline of unit actions (F, B and W of a half-stage chunk one unit each), ZB-V's step takes
    6M + P - 1 units once M >= 2P-1: a rank idles P-1 units, where 1F1B's stage idles (P-1)(F+B) = 6(P-1)."""
    for n_micro in range(2 * n_stages - 1, 4 * n_stages):
        schedules = [pp.make_schedule("zbv", n_micro, n_stages, r, 2) for r in range(n_stages)]
        steps = pp.timeline(schedules, pp.Placement.of("zbv", n_stages, 2))
        assert len(steps) == 6 * n_micro + n_stages - 1
        idle = pp.bubble_formula(n_stages, n_micro, 2, "zbv")
        assert idle == pytest.approx((n_stages - 1) / (6 * n_micro + n_stages - 1))
        one_f_one_b = pp.bubble_formula(n_stages, n_micro)
        assert idle / one_f_one_b == pytest.approx((n_micro + n_stages - 1) / (6 * n_micro + n_stages - 1))
    for n_micro in range(1, 2 * n_stages - 1):  # fewer: the warm-up's gaps stay, but it still beats 1F1B
        assert pp.bubble_formula(n_stages, n_micro, 2, "zbv") < pp.bubble_formula(n_stages, n_micro)


def test_placements_say_which_rank_holds_each_chunk():
    loop, v = pp.Placement.of("interleaved", 4, 2), pp.Placement.of("zbv", 4, 2)
    assert [loop.model_chunks(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [v.model_chunks(r) for r in range(4)] == [v_model_chunks(4, r) for r in range(4)]
    assert [v.holder(k) for k in (0, 3, 4, 7)] == [(0, 0), (3, 0), (3, 1), (0, 1)]
    assert loop.ends_apart() and not v.ends_apart()  # in a V, rank 0 holds the first and the last chunk
    assert pp.Placement.of("1f1b", 4).model_chunks(2) == [2]


# -- NCCL's rules: messages match by posting order, batches run one after the other ----------

PLANS = [(schedule, n_chunks, n_stages, groups * n_stages)
         for schedule, n_chunks in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb1", 1),
                                    ("zbv", 2), ("combined", 1)]
         for n_stages in (2, 3, 4) for groups in (1, 2, 3)]


def run_batches_as_nccl(posted):
    """Run every rank's batches (pp.exchanges) as NCCL would, or fail on a deadlock.

    A rank's batches run one after the other (one communicator, one stream), and an operation
    completes only when its peer's current batch holds the matching one (a large send waits for
    its receiver). Matching is by order alone: the n-th send from a to b is the n-th receive b posts
    from a. Returns, per rank, the batch in which each message arrived.
    """
    n = len(posted)
    queues = {}  # (source, destination) -> the messages the destination will receive, in order
    for rank, batches in enumerate(posted):
        for _, receives in batches:
            for source, message in receives:
                queues.setdefault((source, rank), []).append(message)
    current = [0] * n
    left = [[*sends, *receives] for sends, receives in (batches[0] for batches in posted)]
    arrived = [{} for _ in range(n)]
    while any(current[r] < len(posted[r]) for r in range(n)):
        progressed = False
        for a in range(n):
            for b, message in [op for op in left[a] if op in posted[a][current[a]][0]]:  # a's sends
                if current[b] < len(posted[b]) and (a, queues[a, b][0]) in left[b]:
                    assert queues[a, b].pop(0) == message, f"stage {b} would take {message} for another message"
                    left[a].remove((b, message))
                    left[b].remove((a, message))
                    arrived[b][message] = current[b]
                    progressed = True
        for r in range(n):
            while current[r] < len(posted[r]) and not left[r]:
                current[r] += 1
                left[r] = [*posted[r][current[r]][0], *posted[r][current[r]][1]] if current[r] < len(posted[r]) else []
                progressed = True
        assert progressed, f"deadlock: stages are at batches {current}"
    return arrived


@pytest.mark.parametrize("schedule,n_chunks,n_stages,n_micro", PLANS, ids=lambda v: str(v))
def test_messages_match_by_order_alone_and_never_deadlock_under_nccl(schedule, n_chunks, n_stages, n_micro):
    schedules = [pp.make_schedule(schedule, n_micro, n_stages, r, n_chunks) for r in range(n_stages)]
    placement = pp.Placement.of(schedule, n_stages, n_chunks)
    steps = pp.timeline(schedules, placement)
    for r in range(n_stages):  # every action runs once, in its rank's order
        assert [row[r] for row in steps if row[r]] == schedules[r]
    posted = [pp.exchanges(steps, r, placement) for r in range(n_stages)]
    for source in range(n_stages):  # the n-th send from a rank to another is the n-th receive posted there
        for destination in range(n_stages):
            sent = [m for sends, _ in posted[source] for d, m in sends if d == destination]
            received = [m for _, receives in posted[destination] for s, m in receives if s == source]
            assert sent == received
    # On the wire: a message from a rank to itself (the turn of a V) is handed over (pp._P2P), not posted.
    wire = [[([s for s in sends if s[0] != r], [x for x in receives if x[0] != r]) for sends, receives in batches]
            for r, batches in enumerate(posted)]
    arrived = run_batches_as_nccl(wire)
    for t, row in enumerate(steps):  # and each action's input arrived in a batch posted before it runs
        for r, action in enumerate(row):
            for need in (pp.message_needed(half, r, placement) for half in pp.halves(action)):
                if need and placement.holder(need[1])[0] != r:
                    assert arrived[r][need] < t


def test_two_stages_interleaved_send_both_kinds_over_one_link():
    """Why order matters: with P=2 and V=2, stage 0 sends stage 1 activations (chunk 0 -> 1) and gradients
    (chunk 2 -> 1) over the same link, in shapes alike, so a receive matched out of order would silently
    take a gradient for an activation."""
    schedules, placement = [pp.make_schedule("interleaved", 4, 2, r, 2) for r in range(2)], pp.Placement(2, 2)
    sent = [m for sends, _ in pp.exchanges(pp.timeline(schedules, placement), 0, placement) for _, m in sends]
    assert {kind for kind, _, _ in sent} == {"activation", "gradient"}


def tag_worker():
    """Rank 0 sends two messages tagged 1 and 2; rank 1 posts the receive tagged 2 first."""
    first, second = torch.zeros(1), torch.zeros(1)
    if dist.get_rank() == 0:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1), 1, tag=1),
                                        dist.P2POp(dist.isend, torch.full((1,), 2.0), 1, tag=2)])
    else:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, first, 0, tag=2),
                                        dist.P2POp(dist.irecv, second, 0, tag=1)])
    for work in works:
        work.wait()
    return first.item(), second.item()


def test_ranks_run_under_nccls_rule_tags_are_ignored():
    """The test ranks (distributed.py) match point-to-point messages by order alone, as NCCL does; with
    tags honoured, the receive tagged 2 would take the second message."""
    assert run_on_ranks(2, tag_worker)[1] == (1.0, 2.0)


def test_forward_only_runs_each_forward_once_in_schedule_order():
    assert pp.forward_only(4, 2, 0, 1) == [("forward", 0, m) for m in range(4)]
    interleaved = [a for a in pp.interleaved_1f1b(4, 2, 0, 2) if a[0] == "forward"]
    assert pp.forward_only(4, 2, 0, 2) == interleaved
    for n_stages in (2, 3, 4):  # evaluation under ZB-V: the same order, in a V
        for n_micro in (1, n_stages, 2 * n_stages):
            forwards = [pp.forward_only(n_micro, n_stages, r, 2) for r in range(n_stages)]
            steps = pp.timeline(forwards, pp.Placement.of("zbv", n_stages, 2))
            assert sum(action is not None for row in steps for action in row) == 2 * n_stages * n_micro


def test_split_layers_is_as_even_as_possible():
    assert pp.split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert pp.split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline chunks"):
        pp.split_layers(3, 4)
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        pp.make_schedule("interleaved", 3, 2, 0, 2)


@pytest.mark.parametrize("flags,message", [
    (["--pp", "2", "--schedule", "interleaved", "--micro-batches", "3"], "multiple of the pipeline size"),
    (["--pp", "2", "--schedule", "interleaved", "--micro-batches", "2"], "2 layers cannot fill 4 pipeline chunks"),
    (["--schedule", "interleaved"], "need pipeline parallelism (--pp > 1)"),
    (["--pp", "2", "--schedule", "zb1", "--recompute", "full"], "--schedule zb1 with --recompute is not supported"),
    (["--pp", "2", "--schedule", "zbv", "--recompute", "full"], "--schedule zbv with --recompute is not supported"),
    (["--pp", "2", "--schedule", "zbv", "--virtual-stages", "3"], "ZB-V places exactly two chunks on each rank, not 3"),
    (["--schedule", "zbv"], "--schedule zbv and --virtual-stages need pipeline parallelism (--pp > 1)"),
    (["--pp", "2", "--schedule", "combined"], "--schedule combined pairs micro-batches"),
    (["--pp", "2", "--schedule", "combined", "--experts", "4", "--ep-overlap", "2"], "needs --experts and --ep-overlap 1"),
    (["--pp", "2", "--schedule", "zbv", "--micro-batches", "2"], "2 layers cannot fill 4 pipeline chunks"),
])
def test_refused_pipeline_flags(flags, message):
    with pytest.raises(cli.ConfigError, match=re.escape(message)):
        cli.check_args(cli.parse_args(["--model", "tiny", "--batch-size", "12", *flags]), 2)


def test_self_check_runs_alone_in_an_empty_folder(tmp_path):
    differences = self_check_alone("pp.py", 4, tmp_path)  # GPipe, 1F1B, ZB-H1, combined, interleaved, ZB-V
    assert len(differences) == 6 and max(differences) < 1e-12
