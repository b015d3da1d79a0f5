"""Which rank is slow: each rank's compute time against the median of the ranks doing the same work.

A straggler hides behind the step's collectives: the others wait for it in the gradients' reduction, so
every rank's step takes as long as the slowest's. What tells it apart is the time each rank spends
computing (the log's compute_s) against the ranks of its own pipeline stage, which run the same layers on
as many tokens: the straggler computes longer, and the others' time waiting in collectives (comm_wait_s)
grows by as much. Within a tensor-parallel group, the time a rank waits in tp's collectives inside the
forward counts as computing: a slow rank slows its tp peers alike, and the group stands out as a whole.
"""
import statistics

SLOW = 1.2  # a rank computing 20% longer than its stage's median: beyond the noise between equal ranks
MIN_STEPS = 3  # fewer steps than this say nothing of a rank: the first carries start-up work


def slowest(compute_s, stage_of):
    """(rank, its compute time over the median of its stage's ranks) of the rank slowest against its stage."""
    stages = {}
    for rank, seconds in enumerate(compute_s):
        stages.setdefault(stage_of[rank], []).append(seconds)
    ratios = [seconds / max(statistics.median(stages[stage_of[rank]]), 1e-9) for rank, seconds in enumerate(compute_s)]
    rank = max(range(len(ratios)), key=ratios.__getitem__)
    return rank, ratios[rank]


def report(entries):
    """A line naming the straggler of a run's log records (each with slowest_rank, slowest_compute_ratio,
    compute_s and comm_wait_s per rank), or None: the rank slowest by SLOW or more in at least half the
    steps (of MIN_STEPS or more), how much slower, and how long the others waited a step meanwhile."""
    slow = [e for e in entries if e["slowest_compute_ratio"] >= SLOW]
    if len(entries) < MIN_STEPS or len(slow) * 2 < len(entries):
        return None
    rank = statistics.mode(e["slowest_rank"] for e in slow)
    mine = [e for e in slow if e["slowest_rank"] == rank]
    if len(mine) * 2 < len(entries):
        return None
    ratio = statistics.mean(e["slowest_compute_ratio"] for e in mine)
    others_waited = statistics.mean(statistics.mean(w for r, w in enumerate(e["comm_wait_s"]) if r != rank)
                                    for e in mine)
    waited = statistics.mean(e["comm_wait_s"][rank] for e in mine)
    return (f"straggler: rank {rank} computed {ratio:.2f}x the median of its stage's ranks in {len(mine)} of "
            f"{len(entries)} steps; the other ranks waited {others_waited * 1e3:.0f} ms a step in collectives, "
            f"rank {rank} {waited * 1e3:.0f} ms")
