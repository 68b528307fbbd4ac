"""AEnt's settings in the reproduction scripts: one translation of the reference's warm-up serves every script."""

import os

from test_compare import dry_run

import grpo_aent as ga

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPRODUCE = os.path.join(ROOT, "benchmarks", "reproduce")


def aent_commands(script: str) -> list:
    """The grpo_aent.py flags of each command a reproduction script prints with DRY_RUN=1 and only AEnt selected."""
    commands = dry_run(script, METHODS="grpo_aent", SEEDS="1")
    return [c[c.index("grpo_aent.py") + 1 :] for c in commands if "grpo_aent.py" in c]


def first_new_coef_step(warmup: int, steps: int = 400) -> int:
    """The first training step (from 1) that trains with a coefficient other than coef_0 under grpo_aent.py's rule: the
    loop (step from 0) steps the coefficient after step `step` when step >= --entropy-coef-warmup, with the entropy
    outside the box."""
    coef = 0.002
    for step in range(steps):
        if coef != 0.002:
            return step + 1
        if step >= warmup:
            box = dict(low=0.15, high=0.24, lr=0.002, reg=0.0, init_coef=0.002, coef_min=6e-4, coef_max=9e-3)
            coef = ga.next_entropy_coef(coef, 0.0, **box)
    return steps + 1


def test_every_script_translates_the_reference_warmup_once():
    """The reference steps the coefficient when global_steps >= W (from 1): coef_0 in steps 1 to W, the first new one
    at W + 1. Every script that runs grpo_aent.py passes what aent_settings.bash makes of W (MATH 30, OpenR1 156), and
    grpo_aent.py then trains with coef_0 exactly in steps 1 to W."""
    scripts = [s for s in sorted(os.listdir(REPRODUCE)) if s.endswith(".sh")]
    # testbed.sh scales every setting to the testbed (its comment says how): no published warm-up to translate
    runs_aent = [s for s in scripts if "grpo_aent)" in open(os.path.join(REPRODUCE, s)).read() and s != "testbed.sh"]
    assert len(runs_aent) == 5, runs_aent  # the two AEnt runs, the two Cov runs, the protocol
    reference = {"0.33": 30, "0.25": 156}  # clamp_p of the MATH and the OpenR1 run -> their warm-up
    for script in runs_aent:
        commands = aent_commands(os.path.join(REPRODUCE, script))
        assert commands, script
        for flags in commands:
            warmup = int(flags[flags.index("--entropy-coef-warmup") + 1])
            W = reference[flags[flags.index("--clamp-p") + 1]]
            assert warmup == W - 1, (script, warmup, W)
            assert first_new_coef_step(warmup) == W + 1, script
