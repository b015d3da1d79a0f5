"""Two tiers of tests. `python -m pytest -q` runs the first: each dimension against one device, one composition
of all five, the copy tests, the model against the Hugging Face folders, checkpoints, data, files and the README
(about ten minutes on 2 slow cores). `python -m pytest -q --full` adds the rest of the matrix, the tests marked
`full`: every other layout, schedule, family and fault (what CI runs). Files or tests named on the command line
run whole, tier or not (`python -m pytest -q tests/test_faults.py`)."""
import os


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the whole matrix: every layout, schedule, family and fault (the tests marked full)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or any(os.path.exists(arg.split("::")[0]) for arg in config.invocation_params.args):
        return
    later = [item for item in items if item.get_closest_marker("full")]
    if later:
        config.hook.pytest_deselected(items=later)
        items[:] = [item for item in items if not item.get_closest_marker("full")]
