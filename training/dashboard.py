"""The logged scalars for TensorBoard (train.py --tensorboard), where the tensorboard package is installed.

The run's log (log.jsonl) stays the record; this writes a copy of its scalars into the run folder's
tensorboard/ for `tensorboard --logdir runs`: the loss, the validation loss, the learning rate, the gradient
norm, tokens per second, MFU, and per rank the times and memory a straggler or a leak would show in.
The project does not depend on tensorboard: without --tensorboard nothing of it is imported.
"""
import importlib.util
import os

SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_s")
PER_RANK = ("compute_s", "comm_wait_s", "activation_peak_bytes", "peak_resident_bytes", "device_peak_bytes")


def available():
    """Whether the tensorboard package is installed (torch.utils.tensorboard needs it)."""
    return importlib.util.find_spec("tensorboard") is not None


class Dashboard:
    """A step's scalars into `folder`/tensorboard, as TensorBoard's SummaryWriter writes them."""

    def __init__(self, folder):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(os.path.join(folder, "tensorboard"))

    def write(self, entry):
        step = entry["step"]
        for name in SCALARS:
            if entry.get(name) is not None:
                self.writer.add_scalar(name, entry[name], step)
        for name in PER_RANK:
            for rank, value in enumerate(entry.get(name) or ()):
                if value is not None:
                    self.writer.add_scalar(f"{name}/rank{rank}", value, step)

    def close(self):
        self.writer.close()


class NoDashboard:
    """Without --tensorboard (or on ranks that do not write the log): nothing."""

    def write(self, entry):
        pass

    def close(self):
        pass
