"""The design the method files promise: each is grpo_vanilla.py plus its method. Every top-level function and class of
grpo_vanilla.py is in each method file with the same source, except the few listed here; in those and in the main
block, vanilla's lines appear in the method file in the same order, and the only vanilla lines a method replaces are
the ones listed. A change to the shared part that misses a file, or a method edit that leaks into the shared part,
fails here."""

import ast
import difflib
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# top-level definitions a method changes (the rest must be identical), and the vanilla lines it replaces in them
CHANGED = {
    "grpo_aent.py": {
        "Args": [],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": [
            "start_step, consumed, method_state = 0, 0, {}",
            "logp, entropy, _ = logprobs(policy, batch, with_entropy=True)",
            "logp, entropy, _ = logprobs(policy, batch, with_entropy=train_entropy)",
        ],
    },
    "grpo_entreg.py": {
        "Args": [],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": [
            "start_step, consumed, method_state = 0, 0, {}",
            "logp, entropy, _ = logprobs(policy, batch, with_entropy=True)",
            "logp, entropy, _ = logprobs(policy, batch, with_entropy=train_entropy)",
        ],
    },
    "grpo_klcov.py": {
        "Args": [
            '"""optimizer updates per rollout batch and epoch (the batch is split into this many mini-batches)"""'
        ],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": ["token_loss, clipped = ppo_clip_loss(logp, old_logp, adv, *clip)"],
    },
    "grpo_clipcov.py": {
        "Args": [
            "clip_eps_low: float = 0.2",
            '"""PPO lower clip: ratio >= 1 - eps_low"""',
            "clip_eps_high: float = 0.2",
            '"""PPO upper clip: ratio <= 1 + eps_high (DAPO\'s clip-higher: 0.28)"""',
        ],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": [],
    },
    "grpo_entadv.py": {
        "Args": [],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": ["logp, entropy, _ = logprobs(policy, batch, with_entropy=train_entropy)"],
    },
    "grpo_cispo.py": {
        "Args": ["clip_eps_low: float = 0.2", '"""PPO lower clip: ratio >= 1 - eps_low"""'],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": ["token_loss, clipped = ppo_clip_loss(logp, old_logp, adv, *clip)"],
    },
    "grpo_cegppo.py": {
        "Args": [
            "clip_ratio_c: float = 0.0",
            '"""dual clip: where A < 0 the loss is at most -A c (verl\'s clip_ratio_c, its default 3); 0: PPO\'s clip '
            'alone"""',
        ],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": ["token_loss, clipped = ppo_clip_loss(logp, old_logp, adv, *clip)"],
    },
    "grpo_lpreg.py": {
        "Args": [
            "clip_eps_low: float = 0.2",
            '"""PPO lower clip: ratio >= 1 - eps_low"""',
            "clip_eps_high: float = 0.2",
            '"""PPO upper clip: ratio <= 1 + eps_high (DAPO\'s clip-higher: 0.28)"""',
        ],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": ["logp, entropy, _ = logprobs(policy, batch, with_entropy=True)"],
    },
    "grpo_sapo.py": {
        "Args": ['loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"'],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": ["token_loss, clipped = ppo_clip_loss(logp, old_logp, adv, *clip)"],
    },
    "grpo_gspo.py": {
        "Args": [
            "clip_eps_low: float = 0.2",
            '"""PPO lower clip: ratio >= 1 - eps_low"""',
            "clip_eps_high: float = 0.2",
            '"""PPO upper clip: ratio <= 1 + eps_high (DAPO\'s clip-higher: 0.28)"""',
            'loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"',
        ],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": ["token_loss, clipped = ppo_clip_loss(logp, old_logp, adv, *clip)"],
    },
    "grpo_wreinforce.py": {
        "Args": [],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": ["advantages = group_advantages(rewards, args.scale_rewards).flatten()"],
    },
    "grpo_passk.py": {
        "Args": [],
        "validate_args": ["check_args(args, world_size, method_checks=[])"],
        "__main__": ["advantages = group_advantages(rewards, args.scale_rewards).flatten()"],
    },
}
# a method file not listed above (a user's own): its Args and validate_args may only add lines (the flags, the
# method's checks before check_args); its main loop is not checked line by line (None)
NEW_METHOD = {
    "Args": [],
    "validate_args": ["check_args(args, world_size, method_checks=[])"],
    "__main__": None,
}
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "grpo_*.py")))
SCRIPTS.remove("grpo_vanilla.py")


def top_level(path: str) -> dict:
    """name -> source lines of each top-level function, class and the `if __name__ == "__main__":` block."""
    source = open(os.path.join(ROOT, path)).read()
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = lines[node.lineno - 1 : node.end_lineno]
        elif isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            found["__main__"] = lines[node.lineno - 1 : node.end_lineno]
    return found


def test_every_method_file_is_checked_for_its_conditionals():
    assert set(METHOD_CONDITIONALS) == {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "grpo_*.py"))}


def test_every_method_file_is_checked():
    assert set(CHANGED) <= set(SCRIPTS), f"listed but missing: {sorted(set(CHANGED) - set(SCRIPTS))}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_method_file_is_vanilla_plus_its_method(script):
    changed = CHANGED.get(script, NEW_METHOD)
    vanilla, method = top_level("grpo_vanilla.py"), top_level(script)
    missing = sorted(set(vanilla) - set(method))
    assert not missing, f"{script} lacks vanilla's {missing}"
    for name, lines in vanilla.items():
        if name not in changed:
            assert method[name] == lines, f"{script}: {name} differs from grpo_vanilla.py's (a shared definition)"
            continue
        if changed[name] is None:
            continue
        matcher = difflib.SequenceMatcher(None, lines, method[name], autojunk=False)
        kept = {i for block in matcher.get_matching_blocks() for i in range(block.a, block.a + block.size)}
        replaced = sorted(line.strip() for i, line in enumerate(lines) if i not in kept)
        assert replaced == sorted(changed[name]), f"{script}: {name} replaces other vanilla lines: {replaced}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_method_definitions_are_under_a_banner(script):
    """A method's own top-level definitions sit together, under one `# ---- <method>: ... ----` banner."""
    vanilla = top_level("grpo_vanilla.py")
    source = open(os.path.join(ROOT, script)).read().splitlines()
    own = [n for n in ast.parse("\n".join(source)).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    own = [n for n in own if n.name not in vanilla]
    assert own, f"{script} defines no function of its own"
    banner = [i for i, line in enumerate(source) if line.startswith("# ---- ")]
    assert len(banner) == 1 and banner[0] == own[0].lineno - 2, f"{script}: no banner right above {own[0].name}"
    first, last = own[0].lineno, own[-1].end_lineno
    shared_inside = [
        n.name
        for n in ast.parse("\n".join(source)).body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in vanilla and first <= n.lineno <= last
    ]
    assert not shared_inside, f"{script}: shared {shared_inside} inside the method's block"


def test_no_file_points_outside_the_repository():
    """Users have only this repository: no tracked file cites the developers' notes folder beside it."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    outside = "../" + "shared"  # not spelled out here, or this file would match
    hits = []
    for name in files:
        try:
            with open(os.path.join(ROOT, name), encoding="utf-8") as f:
                hits += [name] if outside in f.read() else []
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files (plots, weights)
    assert not hits, hits


# the local names inside the references' own loss functions (verl, TRL, the CE-GPPO, Lp-Reg and Cov authors' code):
# code of ours has no reason to use them, a transcription keeps them. benchmarks/experiments/reference_losses.py runs
# those functions from their files at run time and needs none of these names.
REFERENCE_LOCALS = (
    "clip_pg_losses1 clip_pg_losses2 ratio_detached pg_losses3 pg_clipfrac_lower_mask neg_logp_k all_valid_flat_idx "
    "neg_indices neg_logp_indices target_flat_idx target_kl probability_values max_probabilities invalid_mask "
    "negative_approx_kl clipped_ratio coef_1 clamped_ratios per_token_loss masked_entropies entropy_threshold "
    "cov_lst_all k_percent_nums large_cov_idxs clip_by_corr all_valid_adv all_valid_logp all_valid_idx"
).split()
REFERENCE_FUNCTIONS = (
    "compute_policy_loss_cispo compute_gppo_loss_general_beta compute_policy_loss_lp_reg apply_min_p "
    "get_high_entropy_mask compute_policy_loss_kl_cov compute_policy_loss_clip_cov _compute_loss"
).split()


def test_no_reference_code_is_committed():
    """Only code written here: no tracked file (this one aside) uses the references' local names, and none defines a
    function of theirs; tests state the formulas in their own words (tests/test_remedies.py)."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    local = re.compile(r"\b(" + "|".join(REFERENCE_LOCALS) + r")\b")
    defined = re.compile(r"^\s*def (" + "|".join(REFERENCE_FUNCTIONS) + r")\(", re.M)
    hits = []
    for name in files:
        if name == "tests/test_design.py":
            continue
        try:
            with open(os.path.join(ROOT, name), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files (plots, weights)
        hits += [f"{name}: {m.group(1)}" for m in [*local.finditer(text), *defined.finditer(text)]]
    assert not hits, hits


def imports(path: str, modules: set) -> set:
    """The repository modules a file imports anywhere in it (function-level imports too), from its `ast`."""
    package = os.path.dirname(path).replace(os.sep, ".")
    found = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package if node.level else ""
            base = ".".join(filter(None, [base, node.module]))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found & modules


def test_no_import_cycle():
    """utils/ is in layers: no module reaches a module that imports it (a lower layer takes what it needs as an
    argument), so each can be read, tested and changed from the bottom up."""
    files = [p for p in glob.glob("**/*.py", root_dir=ROOT, recursive=True) if not p.startswith((".venv", "runs"))]
    names = {p[: -len(".py")].replace(os.sep, "."): p for p in files}
    graph = {name: imports(path, set(names)) - {name} for name, path in names.items()}
    assert {"utils.split_launch", "utils.rollouts"} <= graph["utils.rollout_rank"]  # relative imports are seen
    # process setup is the floor the rollout-rank feature stands on, not the other way up
    assert "utils.distributed" in graph["utils.split_launch"] and graph["utils.distributed"] <= {"utils.versions"}

    def cycle_from(start, node, path):
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*path, nxt]
            if nxt not in path and (found := cycle_from(start, nxt, [*path, nxt])):
                return found
        return None

    for name in sorted(n for n in graph if n.startswith("utils.")):
        cycle = cycle_from(name, name, [name])
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_readme_names_every_utils_module_and_the_sizes_hold():
    """README's "How to read the code" has a line for each utils/ module; the files stay short enough to read in one
    sitting: vanilla <= 450 lines, a method <= 650, a utils/ module or a testbed builder <= 400, README <= 300."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    modules = sorted(p for p in glob.glob("utils/*.py", root_dir=ROOT) if not p.endswith("__init__.py"))
    assert not [m for m in modules if f"`{m}`" not in readme], "README does not name these"

    def lines(path):
        return len(open(os.path.join(ROOT, path)).read().splitlines())

    limits = {"grpo_vanilla.py": 450, "README.md": 300, **{s: 650 for s in SCRIPTS}}
    limits |= {m: 400 for m in [*modules, *glob.glob("testbed/*.py", root_dir=ROOT)]}
    assert not {p: lines(p) for p, limit in limits.items() if lines(p) > limit}, "over their limits"


# the conditionals a method's loop adds to vanilla's, and why (vanilla's loop: at most 8, as CleanRL's ppo.py's)
METHOD_CONDITIONALS = {
    "grpo_vanilla.py": 0,
    "grpo_aent.py": 3,  # the bonus's synced tokens (twice), the box rule
    "grpo_entreg.py": 9,  # the synced tokens (twice), the target rule's gate, cadences and signals, the schedule
    "grpo_klcov.py": 3,  # the global or micro-batch selection (twice), the penalty's metrics
    "grpo_clipcov.py": 3,  # the same
    "grpo_lpreg.py": 3,  # the same
    "grpo_cegppo.py": 2,  # the SFT term: its mask, its loss
    "grpo_cispo.py": 0,
    "grpo_entadv.py": 0,
    "grpo_sapo.py": 0,
    "grpo_gspo.py": 0,
    "grpo_wreinforce.py": 1,  # the authors' entropy bonus (off by default)
    "grpo_passk.py": 0,
}


def loop_conditionals(path: str) -> int:
    """The ifs (statements and expressions) in a script's training loop, `for step in ...`."""
    tree = ast.parse(open(path).read())
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For) and getattr(n.target, "id", None) == "step")
    return sum(isinstance(n, (ast.If, ast.IfExp)) for n in ast.walk(loop))


@pytest.mark.parametrize("script", sorted(METHOD_CONDITIONALS))
def test_the_loop_reads_like_ppo_py(script):
    """Vanilla's loop has at most 8 conditionals; a method's at most vanilla's and what its method needs."""
    base = loop_conditionals(os.path.join(ROOT, "grpo_vanilla.py"))
    assert base <= 8
    assert loop_conditionals(os.path.join(ROOT, script)) <= base + METHOD_CONDITIONALS[script]


def test_args_shows_what_a_method_reader_tunes():
    """Vanilla's Args holds at most 50 fields (the engine's flags nested in one, utils/engine.py); AEnt's file, the
    method this repository started from, differs from vanilla's by at most 160 lines."""
    tree = ast.parse(open(os.path.join(ROOT, "grpo_vanilla.py")).read())
    args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    assert sum(isinstance(n, ast.AnnAssign) for n in args.body) <= 50
    vanilla, aent = (open(os.path.join(ROOT, f)).read().splitlines() for f in ("grpo_vanilla.py", "grpo_aent.py"))
    changed = [line for line in difflib.ndiff(vanilla, aent) if line.startswith(("- ", "+ "))]
    assert len(changed) <= 160, len(changed)
