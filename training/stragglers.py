"""Which rank is slow: the rank the others of its group wait for, step after step.

A straggler hides behind the step's collectives: its peers wait for it, so every rank's step takes as long
as its. What tells it apart is who waits for whom. Each rank logs, per step, its computing (compute_s)
and its waiting for communication (comm_wait_s: the gradients' reduction, the pipeline's messages), and
of its computing the time inside the step's other blocking collectives (collective_s: tensor
parallelism's all-reduces, ZeRO-3's gathers, the experts' all-to-alls, the gradient norm's sum; timed by
CollectiveClock). A rank's own work is compute_s - collective_s, its waiting comm_wait_s + collective_s:
the slow rank of a tensor-parallel pair works longer, and its partner waits for it in their all-reduces.

Its group: the ranks of its pipeline stage (dp x cp x tp), which run the same layers on as many tokens
and meet in collectives every step. Ranks of other stages run other layers: they are not compared.

The rule, each step: a rank is waited for when, against its peers (the others of its group, itself left
out of their median), it works longer by d = its work - their median work, where
    its work >= SLOW x their median work,
    d >= DELAY x its step (its compute_s + comm_wait_s, as long as every rank's of the group), and
    their median waiting - its waiting >= WAITED x d;
a run's straggler is a rank waited for in at least half of its steps (of MIN_STEPS or more).

Why so:
- itself left out: with two ranks, a median that includes the straggler is the mean of it and its peer,
  so a rank 1.5x slower than its peer would be only 1.2x "the median";
- SLOW = 1.2: beyond the noise between equal ranks (a few percent on GPUs, ~10% for processes sharing a
  CPU's cores); a group slowed alike (every rank) has no rank above its peers and names none;
- DELAY = 0.1: a delay the others notice. When a whole stage waits for another stage's straggler, its
  ranks' work is a small part of their step, and a few milliseconds of noise are 1.2x of it;
- WAITED = 0.5: a rank working longer by d makes its peers wait about d at their next collective; half of
  it leaves room for what overlap hides (buckets reduced during the backward) and rules out a rank whose
  long work nobody waited for;
- half the steps: one slow step (the first one's start-up, a page fault, a collection) is no straggler.

What is not timed: cp's ring messages and the experts' all-to-alls run beside computing (--ep-overlap)
are waited for inside computing, so a slow rank's ring or exchange partners look as slow as it.
"""
import collections
import contextlib
import statistics

import torch.distributed as dist

from pp import Stopwatch
from training import flight

SLOW = 1.2     # its work over its peers' median: beyond the noise between equal ranks
DELAY = 0.1    # its extra work, as a share of its step: a delay the others notice
WAITED = 0.5   # its peers' extra waiting, as a share of its extra work: they waited for it
MIN_STEPS = 3  # fewer steps than this say nothing of a rank: the first carries start-up work
NONE = (f"no straggler: no rank worked {SLOW:g}x the others of its pipeline stage while they waited for it, "
        "in half the steps")


def waited_for(compute_s, comm_wait_s, collective_s, group_of):
    """The ranks their peers waited for in one step (the rule above), each with the evidence: its work and
    waiting and its peers' (medians), in seconds (work_s, peers_work_s, wait_s, peers_wait_s). The
    arguments are per rank; group_of[r] is r's group."""
    work = [c - k for c, k in zip(compute_s, collective_s)]
    waiting = [w + k for w, k in zip(comm_wait_s, collective_s)]
    found = []
    for rank, group in enumerate(group_of):
        peers = [r for r, g in enumerate(group_of) if g == group and r != rank]
        if not peers:
            continue
        peers_work = statistics.median(work[p] for p in peers)
        peers_waiting = statistics.median(waiting[p] for p in peers)
        extra = work[rank] - peers_work
        if (work[rank] >= SLOW * peers_work and extra >= DELAY * (compute_s[rank] + comm_wait_s[rank])
                and peers_waiting - waiting[rank] >= WAITED * extra):
            found.append(dict(rank=rank, work_s=work[rank], peers_work_s=peers_work,
                              wait_s=waiting[rank], peers_wait_s=peers_waiting))
    return found


def report(steps):
    """A line for each straggler of a run, from each step's waited_for, or None: the rank waited for in at
    least half the steps (of MIN_STEPS or more), with its work against its peers' and their waiting on it
    against its own (means over the steps it was waited for)."""
    if len(steps) < MIN_STEPS:
        return None
    named = collections.defaultdict(list)
    for found in steps:
        for evidence in found:
            named[evidence["rank"]].append(evidence)
    lines = []
    for rank, evidence in sorted(named.items()):
        if len(evidence) * 2 < len(steps):
            continue
        mean = {k: statistics.mean(e[k] for e in evidence) for k in evidence[0] if k != "rank"}
        lines.append(f"straggler: rank {rank}, waited for by the others of its pipeline stage in {len(evidence)} of "
                     f"{len(steps)} steps: it computed {mean['work_s'] * 1e3:.0f} ms a step against their "
                     f"{mean['peers_work_s'] * 1e3:.0f} ms ({mean['work_s'] / mean['peers_work_s']:.2f}x); "
                     f"they waited {mean['peers_wait_s'] * 1e3:.0f} ms a step in collectives, it "
                     f"{mean['wait_s'] * 1e3:.0f} ms")
    return "\n".join(lines) or None


class CollectiveClock:
    """This rank's time inside the step's blocking collectives (the log's collective_s): waiting there for
    its peers, and moving the data.

    While installed (`with clock:`), torch.distributed's collectives and this repository's names for them
    are wrapped, as flight.py's recorder wraps them; a call counts between start() and stop(), outside
    paused() (the gradients' reduction: comm_wait_s has it), and only on `groups` (the mesh's) or the
    default group: the checkpoint saver's thread, on a group of its own, counts nothing. The time is the
    device's (pp.Stopwatch): on a GPU, events on the stream around a call span its wait for NCCL's. An
    asynchronous call counts only its issue; its wait is the caller's to time.
    """

    def __init__(self, device, groups):
        self.device, self.groups = device, {id(g) for g in (*groups, None, dist.group.WORLD)}
        self.stopwatch, self.originals = None, {}

    def __enter__(self):
        self.originals = flight.wrap_collectives(self.timing)
        return self

    def __exit__(self, *_):
        flight.restore_collectives(self.originals)
        self.originals = {}

    def timing(self, name, original):
        def timed(*args, **kwargs):
            stopwatch, group = self.stopwatch, kwargs.get("group", flight.group_argument(name, args))
            if stopwatch is None or id(group) not in self.groups:
                return original(*args, **kwargs)
            start = stopwatch.now()
            result = original(*args, **kwargs)
            stopwatch.add(start, stopwatch.now())
            return result
        timed.__wrapped__ = original
        return timed

    def start(self):
        self.stopwatch = Stopwatch(self.device)

    @contextlib.contextmanager
    def paused(self):
        stopwatch, self.stopwatch = self.stopwatch, None
        yield
        self.stopwatch = stopwatch

    def stop(self):
        """The seconds counted since start()."""
        stopwatch, self.stopwatch = self.stopwatch, None
        return stopwatch.seconds()

