# The metric names the grpo_*.py scripts log, by concern, for compare.py and wandb_report.py; docs: README.md
# (The same name means the same quantity in every script; a method's own metrics are absent from the other runs.)

# AEnt's H_S, its coefficient, as applied (grpo_entreg.py's bonus logs the same: its entropy, coefficient, gated one)
AENT = ("entropy/clamped", "entropy/coef", "entropy/coef_applied")
# every method: the mean entropy of the step's 20% highest-entropy tokens (the forking tokens), beside the full mean
ENTROPY = ("entropy/full", "entropy/top20", *AENT)
# every method: the share of tokens whose ratio left the clip range, by side and sign of A (PPO silences high_pos and
# low_neg; CISPO keeps their gradient with a capped weight, CE-GPPO a bounded one)
CLIP = (
    "losses/clip_frac",
    "losses/clip_frac_high_pos",
    "losses/clip_frac_low_neg",
    "losses/clip_frac_high_neg",
    "losses/clip_frac_low_pos",
)
# --top-entropy-quantile < 1 (every method): the kept tokens' mean entropy, their share, the entropy threshold
SELECTION = ("entropy/kept", "entropy/kept_frac", "entropy/mask_threshold")
REWARD = ("rollout/reward", "rollout/accuracy")
# --filter-groups (DAPO's dynamic sampling, every method): generation rounds, groups generated, the share dropped
SAMPLING = ("rollout/gen_rounds", "rollout/generated_groups", "rollout/filtered_frac")
EVAL = ("eval/acc", "eval/response_length")  # greedy, on --eval-dataset, every --eval-every steps
# with --eval-samples k: k samples per eval prompt at the training temperature (pass@k for k = 2, 4, 8, ... and k)
EVAL_SAMPLED = ("eval/mean_acc", "eval/pass@16", "eval/entropy")
# every method: the first response token, where a response commits to its approach (testbed/build_fork.py's fork)
OPENING = ("rollout/first_token_minority", "entropy/first_token")
COV = ("cov/selected_frac", "cov/selected_mean", "cov/mean", "cov/kl_selected", "cov/clipped_frac")  # KL-Cov, Clip-Cov
THROUGHPUT = ("charts/tokens_per_second",)
TIME = ("time/step", "time/generation", "time/logprob", "time/training", "time/weight_push", "time/cov_selection")

# the namespaces of the shared metrics and of the known methods'; any other `<namespace>/...` metric is a method's
# own (e.g. grpo_entadv.py's entadv/*): compare.py plots them, wandb_report.py gives them a section
KNOWN_NAMESPACES = ("rollout", "entropy", "losses", "charts", "time", "eval", "cov")

LABELS = {
    "entropy/full": "full-vocabulary entropy (nats)",
    "entropy/top20": "entropy of the 20% highest-entropy tokens (nats)",
    "entropy/clamped": "clamped entropy (nats)",
    "entropy/coef": "entropy-bonus coefficient (AEnt, grpo_entreg)",
    "entropy/coef_applied": "entropy-bonus coefficient as applied (0: gated)",
    "entropy/kept": "entropy of the kept tokens (nats)",
    "entropy/kept_frac": "fraction of tokens kept (80/20 rule)",
    "entropy/mask_threshold": "entropy threshold of the kept tokens (nats)",
    "eval/acc": "held-out accuracy, greedy",
    "eval/mean_acc": "held-out accuracy, sampled (mean@k)",
    "eval/pass@16": "held-out pass@16",
    "eval/entropy": "entropy of held-out samples (nats)",
    "rollout/gen_rounds": "dynamic sampling: generation rounds per step",
    "rollout/generated_groups": "dynamic sampling: groups generated per step",
    "rollout/filtered_frac": "dynamic sampling: share of groups dropped (all equal)",
    "rollout/first_token_minority": "share of responses not opening with the most frequent first token",
    "entropy/first_token": "entropy of the first response token (nats)",
    "cov/selected_frac": "Cov: fraction of tokens selected",
    "cov/selected_mean": "Cov: mean covariance of the selected",
    "cov/mean": "Cov: mean covariance of all tokens",
    "cov/kl_selected": "KL-Cov: mean |logp - old logp| of the selected",
    "cov/clipped_frac": "Clip-Cov: fraction of tokens without gradient",
    "losses/clip_frac": "fraction of tokens the loss clips (no gradient)",
    "losses/clip_frac_high_pos": "r > 1 + eps_high, A > 0 (PPO clips)",
    "losses/clip_frac_low_neg": "r < 1 - eps_low, A < 0 (PPO clips)",
    "losses/clip_frac_high_neg": "r > 1 + eps_high, A < 0",
    "losses/clip_frac_low_pos": "r < 1 - eps_low, A > 0",
    "charts/tokens_per_second": "tokens per second",
}


def label(metric: str) -> str:
    """A plot label: the description for the less obvious names, else the name itself; seconds for time/*."""
    return LABELS.get(metric, f"{metric} (s)" if metric.startswith("time/") else metric)


def eval_metric(dataset: str, name: str = "acc") -> str:
    """eval/<dataset>/<name>, or the scripts' single-dataset eval/<name> when dataset is ''."""
    return f"eval/{dataset}/{name}" if dataset else f"eval/{name}"


def own_metrics(names) -> dict:
    """The metrics among `names` that no known namespace holds, by namespace: {namespace: sorted names}."""
    own = {}
    for name in sorted(names):
        namespace = name.split("/")[0]
        if "/" in name and namespace not in KNOWN_NAMESPACES:
            own.setdefault(namespace, []).append(name)
    return own
