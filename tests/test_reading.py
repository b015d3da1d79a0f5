"""The shape that lets each dimension file be read beside the article "5D Parallelism from Scratch".

docs/DESIGN's promise, checked with `ast` on the files themselves: a short docstring, the article's
central class or function early, a banner `# ---- Beyond the article ----` within about 480 lines,
and a core above it that names at most a handful of what lies below (the rest reached through seams
a reader can skip). The central signatures keep the article's parameters first and put the others
after a visible `*,  # beyond the article:`. The tools stay in modules a reader can take in.
"""
import ast
import inspect
import os

import pytest

from distributed import REPO

BANNER = "# ---- Beyond the article ----"
MARKER = "*,  # beyond the article:"

# the article's central names in each file, and the parameters the article's version of each takes
CENTRAL = {
    "dp.py": {"DataParallel": ["params", "group", "bucket_bytes"],
              "ZeRO1": ["module", "group", "make_optimizer", "units", "bucket_bytes"]},
    "tp.py": {"ColumnParallelLinear": ["full", "plan"]},
    "pp.py": {"run_schedule": ["schedules", "chunks", "micro_batches", "loss_fn", "group", "shape", "dtype",
                               "device"]},
    "cp.py": {"RingAttention": None, "ring_attention": ["q", "k", "v", "group"]},
    "ep.py": {"ExpertParallelMoE": ["moe", "ep_group", "stats_group"], "route": ["router_logits", "top_k"]},
}
# what a reader meets within the first 200 lines (dp.py's ZeRO classes come after DataParallel's buckets)
EARLY = {"dp.py": ["DataParallel"], "tp.py": ["ColumnParallelLinear"], "pp.py": ["run_schedule"],
         "cp.py": ["ring_attention", "RingAttention"], "ep.py": ["route", "ExpertParallelMoE"]}


def parsed(name):
    with open(os.path.join(REPO, name)) as f:
        source = f.read()
    return source, ast.parse(source)


def docstring_lines(tree):
    """The module docstring's lines, its closing quotes included (it opens the file)."""
    return tree.body[0].end_lineno


def banner_line(source):
    return next(i for i, line in enumerate(source.splitlines(), 1) if line.strip() == BANNER)


def defined(statement):
    """The module-level names a statement defines."""
    if isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
        return [statement.name]
    targets = statement.targets if isinstance(statement, ast.Assign) else \
        [statement.target] if isinstance(statement, ast.AnnAssign) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def names_from_beyond(source, tree):
    """Module-level names defined below the banner that the code above it uses."""
    banner = banner_line(source)
    below = {name for s in tree.body if s.lineno > banner for name in defined(s)}
    return sorted({n.id for s in tree.body if s.lineno < banner for n in ast.walk(s)
                   if isinstance(n, ast.Name) and n.id in below})


def central_signature(tree, name):
    node = next(s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.ClassDef)) and s.name == name)
    if isinstance(node, ast.ClassDef):
        node = next(s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__")
    return node


@pytest.mark.parametrize("name", sorted(CENTRAL))
def test_the_core_reads_without_the_far_side_of_the_banner(name):
    source, tree = parsed(name)
    from_beyond = names_from_beyond(source, tree)
    assert len(from_beyond) <= 5, f"{name}'s core uses {len(from_beyond)} names defined past the banner: {from_beyond}"
    assert banner_line(source) <= 480, f"{name}: the banner at line {banner_line(source)}"
    assert docstring_lines(tree) <= 40, f"{name}: a docstring over 40 lines"
    for central in EARLY[name]:
        line = next(s.lineno for s in tree.body if getattr(s, "name", None) == central)
        assert line <= 200, f"{name}: {central} at line {line}, past the first 200"


@pytest.mark.parametrize("name,central", [(n, c) for n in sorted(CENTRAL) for c in CENTRAL[n] if CENTRAL[n][c]])
def test_the_central_signatures_say_which_parameters_are_the_articles(name, central):
    source, tree = parsed(name)
    node = central_signature(tree, central)
    positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg != "self"]
    assert positional == CENTRAL[name][central], f"{name}: {central}({', '.join(positional)}, ...)"
    header = "\n".join(source.splitlines()[node.lineno - 1:node.body[0].lineno - 1])
    assert not node.args.kwonlyargs or MARKER in header, f"{name}: {central} has no '{MARKER}'"
    assert node.args.vararg is None


def test_the_autograd_function_says_where_its_keywords_are():
    """RingAttention.apply takes its arguments by position only (autograd.Function's rule): its docstring
    names the keyword-only entry a caller uses."""
    import cp
    assert "ring_attention" in inspect.getdoc(cp.RingAttention)


def test_putting_it_all_together_reads_as_one_story():
    source, tree = parsed("train.py")
    assert next(s.lineno for s in tree.body if getattr(s, "name", None) == "parallelize") <= 200
    source, tree = parsed("mesh.py")
    assert docstring_lines(tree) <= 40


def test_no_tool_module_is_over_800_lines():
    long = {}
    for folder, _, files in os.walk(os.path.join(REPO, "tools")):
        for file in files:
            if file.endswith(".py"):
                with open(os.path.join(folder, file)) as f:
                    n = sum(1 for _ in f)
                if n > 800:
                    long[os.path.relpath(os.path.join(folder, file), REPO)] = n
    assert not long, long


def imported_modules(path):
    """Every module a file imports, at its top or inside a function (`from x import y` gives x)."""
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_imports_run_one_way_down():
    """tools/ use training/ and the top level, never the other way: no top-level file nor one of training/ imports
    tools/ (train.py's memory check counts with training/count/); plot.py draws result files, importing
    neither train.py nor tools/."""
    upward = {}
    for folder, _, files in os.walk(REPO):
        relative = os.path.relpath(folder, REPO)
        if relative != "." and relative.split(os.sep)[0] != "training":
            continue
        for file in (f for f in files if f.endswith(".py")):
            path = os.path.normpath(os.path.join(relative, file))
            tools = sorted(name for name in imported_modules(path) if name.split(".")[0] == "tools")
            if tools:
                upward[path] = tools
    assert not upward, upward
    assert not {name.split(".")[0] for name in imported_modules("plot.py")} & {"train", "tools"}
