"""An optimizer update applied or skipped: DeepSpeed skips one whose gradient is non-finite on any rank (on every
rank alike); the run stops, with one line, after too many consecutive steps with a skipped update."""

from . import checkpoints


def record_update(policy, scheduler, grad_norms: list) -> int:
    """After an optimizer update: its global gradient norm (the same on every rank) appended to grad_norms, 0 returned;
    or, where a non-finite gradient on any rank made DeepSpeed skip it on every rank, the LR schedule stepped anyway
    (it follows the optimizer calls) and 1 returned."""
    if policy.was_step_applied():
        grad_norms.append(float(policy.get_global_grad_norm()))
        return 0
    scheduler.step()
    return 1


def check_bad_steps(bad_steps: int, skipped: int, max_bad_steps: int, run_dir: str, tracker) -> int:
    """The count of consecutive steps with a skipped update (a non-finite gradient: DeepSpeed skipped it on every
    rank, the weights are still finite), this step's `skipped` updates included; stops with one line at max_bad_steps,
    naming the newest checkpoint and the metrics."""
    bad_steps = bad_steps + 1 if skipped else 0
    if bad_steps >= max_bad_steps:
        raise SystemExit(
            f"error: {bad_steps} consecutive steps had a non-finite gradient (updates skipped, weights still "
            f"finite); newest checkpoint: {checkpoints.latest(run_dir)}; metrics: {tracker.path}"
        )
    return bad_steps
