"""--deterministic: the settings under which a GPU run repeats bit for bit, run after run on the same machines.

On CPUs (gloo) a run repeats bitwise already: its kernels sum in a fixed order and gloo's reductions too.
On GPUs three things sum in an order that can change from one run to the next, and each has its setting:

- PyTorch's kernels that add with atomics (index_add_, scatter_add_, the fused attention's backward):
  torch.use_deterministic_algorithms(True) picks their deterministic implementations (a sorted index_add_,
  SDPA's backward without split keys), or stops the run at the first operator that has none, naming it;
  cuDNN likewise, without benchmarking algorithms (which may pick another one run to run).
- cuBLAS's reductions: CUBLAS_WORKSPACE_CONFIG=:4096:8 (PyTorch's reproducibility notes: its
  deterministic algorithms require it), read when cuBLAS first runs.
- NCCL's reductions, whose order follows the algorithm and protocol NCCL picks by message size and
  topology: NCCL_ALGO=Ring and NCCL_PROTO=Simple pin one, read when the communicators are made
  (init_distributed makes them), so this runs first.

The optimizers need nothing: fused AdamW and Muon's Newton-Schulz are elementwise updates and matrix products.
What is set is recorded in the run's config.json (`deterministic`), and compared across two runs with
`python -m tools.compare RUN_A RUN_B --assert-equal`.
"""
import os

import torch

# Read by cuBLAS and NCCL when they start: set before either does.
ENVIRONMENT = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


def make_deterministic(cuda):
    """Apply the settings on GPUs (cuda: whether this rank trains on one); returns {setting: value} as set, for
    config.json ({} on CPUs, where nothing needs setting)."""
    if not cuda:
        return {}
    os.environ.update(ENVIRONMENT)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return dict(ENVIRONMENT, use_deterministic_algorithms=True, cudnn_deterministic=True, cudnn_benchmark=False)
