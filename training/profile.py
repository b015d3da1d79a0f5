"""--profile STEPS: a trace of the named steps on every rank, to open in Perfetto (ui.perfetto.dev) or chrome://tracing.

From the first named step to the last, torch.profiler records this rank's operators (and, on CUDA, its kernels)
and the named ranges the code marks with torch.profiler.record_function: `step N` around each step here, the
pipeline's actions (pp.py), ring attention's steps (cp.py), the experts' all-to-alls (ep.py), the gradient
buckets' reductions and ZeRO-3's gathers (dp.py), the clipping and the optimizer (train.py). After the last
step each rank writes <run>/traces/rank<r>.json. A range costs next to nothing while no profiler runs, and a run
without --profile starts none.

On CUDA the allocator's history is recorded over the same steps and dumped to <run>/memory/rank<r>.pickle,
for PyTorch's memory viewer (pytorch.org/memory_viz); an out-of-memory error while the loop runs dumps what
the allocator holds to rank<r>-oom.pickle before it goes on up. See docs/diagnosing.md.
"""
import os
import sys

import torch

MEMORY_HISTORY_ENTRIES = 100000  # the allocator's last allocations and frees kept, with their stacks


def profiled_steps(text):
    """(first, last) of --profile's "N" or "N-M", steps counted from 0; ValueError if it is neither."""
    first, _, last = text.partition("-")
    first, last = int(first), int(last or first)  # (int() refuses "", " ", "a"; a sign makes first > last)
    if not 0 <= first <= last:
        raise ValueError(f"not a range of steps: {text}")
    return first, last


def every_thread():
    """The profiler's option to record every thread's operators, not only the thread that started it: a paired
    pipeline action (pp.py's combined 1F1B) runs its forward in a thread of its own. Private to torch.profiler
    (`_ExperimentalConfig(profile_all_threads=...)`, PyTorch 2.7 on), so looked up: where it is missing the
    trace holds the main thread's operators only."""
    try:
        return dict(experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True))
    except (AttributeError, TypeError):
        return {}


class StepProfiler:
    """The profiler of a run's named steps: train() calls start(step) and stop(step) around each step of its
    loop, and holds it as a context, so a run that ends before the last named step (a signal, bad numbers,
    an error) still writes the steps traced so far. Without steps (no --profile) every call does nothing."""

    def __init__(self, steps, folder, rank, device):
        self.steps, self.folder, self.rank, self.device = steps, folder, rank, device
        self.profiler, self.step_range = None, None  # (created at the first named step)

    @classmethod
    def from_args(cls, args, folder, rank, device):
        return cls(profiled_steps(args.profile) if args.profile else None, folder, rank, device)

    def start(self, step):
        if not self.steps or not self.steps[0] <= step <= self.steps[1]:
            return
        if self.profiler is None:  # the first named step, or the first this run has (a resumed run)
            self._begin()
        self.step_range = torch.profiler.record_function(f"step {step}")
        self.step_range.__enter__()

    def stop(self, step):
        if self.step_range is None:
            return
        self.step_range.__exit__(None, None, None)
        self.step_range = None
        if step == self.steps[1]:
            self._end()

    def __enter__(self):
        return self

    def __exit__(self, error_type, error, traceback):
        if error_type is not None and issubclass(error_type, torch.cuda.OutOfMemoryError) and self.steps:
            self._dump_memory("oom")  # what filled the device, before the error goes on up
        if self.step_range is not None:
            self.step_range.__exit__(error_type, error, traceback)
            self.step_range = None
        if self.profiler is not None:  # the run ended before the last named step: the steps traced so far
            self._end()
        return False

    def _begin(self):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False,
                                               **every_thread())
        self.profiler.start()

    def _end(self):
        self.profiler.stop()
        path = self._path("traces", f"rank{self.rank}.json")
        self.profiler.export_chrome_trace(path)
        self.profiler = None
        if self.device.type == "cuda":
            self._dump_memory()
            self._record_memory_history(enabled=None)  # stop recording: the steps after run at full speed

    # The allocator's history: torch.cuda.memory's private functions _record_memory_history and _dump_snapshot,
    # those PyTorch's memory viewer documents, with these arguments since PyTorch 2.1. Being private they are
    # looked up, not assumed, and a failure of theirs costs the memory's file, not the run: the trace is written
    # all the same. Untested here: the tests run on CPUs, where there is no allocator history.

    def _record_memory_history(self, **options):
        self._allocator("_record_memory_history", **options)

    def _dump_memory(self, kind=None):
        if self.device.type == "cuda":
            name = f"rank{self.rank}-{kind}.pickle" if kind else f"rank{self.rank}.pickle"
            self._allocator("_dump_snapshot", self._path("memory", name))

    def _allocator(self, name, *args, **options):
        """torch.cuda.memory's function `name` called, or where it is missing or fails, a line on stderr."""
        try:
            getattr(torch.cuda.memory, name)(*args, **options)
        except (AttributeError, TypeError, RuntimeError) as e:
            print(f"[rank {self.rank}] --profile: torch.cuda.memory.{name}: {e}; the trace goes on without the "
                  f"allocator's history", file=sys.stderr, flush=True)

    def _path(self, kind, name):
        os.makedirs(os.path.join(self.folder, kind), exist_ok=True)
        return os.path.join(self.folder, kind, name)
