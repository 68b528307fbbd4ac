"""A step's rollouts: prompts from the seeded stream, G samples each, graded; DAPO's dynamic sampling and overlong
reward shaping (Yu et al. 2025, arXiv 2503.14476, as verl's DAPO recipe defines them). Knows no method.

Round 1 generates the stream's next P prompts, each rank its own training slice (utils.data.rank_slots): without
--filter-groups it is the only round and nothing moves between ranks. With --filter-groups the groups whose metric
(correctness, or the shaped reward) is the same for all G samples are dropped, and further rounds generate the
stream's next prompts, split evenly over the ranks and sized from what is still missing and the keep rate so far
(verl generates whole batches of P), until P groups are kept; the step trains the first P kept in stream order. A
prompt's samples are seeded by its stream position, so which groups are trained depends neither on the round sizes
nor on the number of ranks or micro-batches. The next step starts after the last trained prompt: the dropped prompts
before it are consumed (as verl drops them from its epoch), those generated past it are generated again by the next
policy.
"""

import math
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from .data import rank_slots, stream_index
from .reward import grade_all

ROUND_MARGIN = 1.2
"""A further round generates this many times the prompts the keep rate so far predicts are missing."""


class Rollout(NamedTuple):
    prompts: list  # this rank's groups in training order (utils.data.rank_slots): prompt token ids
    samples: list  # G samples per group, group-major
    graded: list  # (reward, status) per sample, as graded (utils.reward.grade_all)
    rewards: torch.Tensor  # [groups, G]: the graded rewards plus the overlong penalty
    consumed: int  # the stream position the next step starts at
    sums: dict  # the generation rounds' counts (rank 0's; zeros on the others: summed over ranks with the step's)
    seconds: tuple  # (generating, grading)


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (verl's DAPO reward manager): 0 up to max_length - buffer tokens, then falling
    linearly to -factor at max_length: min(-(L - (max_length - buffer)) / buffer x factor, 0); buffer 0: off."""
    return min(-(length - (max_length - buffer)) / buffer * factor, 0.0) if buffer else 0.0


def next_round_size(missing: int, kept: int, generated: int, P: int, world_size: int) -> int:
    """Prompts for a further round: what is missing over the keep rate so far, with a margin, at most 2 P (P if
    nothing was kept yet), a multiple of the world size (every rank generates as many)."""
    n = min(2 * P, math.ceil(ROUND_MARGIN * missing * generated / kept)) if kept else P
    return math.ceil(n / world_size) * world_size


def collect(args, consumed: int, train_data: list, tokenizer, sample, grading_workers: int, launch):
    """This rank's groups of the step whose batch starts at stream position `consumed`: a Rollout. `sample(prompts,
    seeds)` returns G samples per prompt (every rank calls it once per round, as collectives may need). Beside
    rollout ranks (`launch`, utils/split_launch.py) they collected it (collect_for): this rank receives it."""
    if launch.trains:
        return launch.receive(consumed)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return collect_for(args, consumed, train_data, tokenizer, sample, grading_workers, [rank], world_size)[1][rank]


def collect_for(args, consumed: int, train_data: list, tokenizer, sample, grading_workers: int, ranks, world_size: int):
    """(the next step's stream position, {rank: its Rollout}) for the training ranks `ranks` of `world_size`: this
    process generates and grades their groups; the processes of its torch.distributed world together cover every
    training rank (the trainers themselves, or the rollout ranks: utils/split_launch.py)."""
    P, G = args.num_prompts_per_step, args.group_size
    groups = {}  # stream position -> (prompt, samples, graded, rewards) of the groups this process generated
    kept, dropped = [], []  # stream positions, all ranks'
    positions = [consumed + j for r in ranks for j in rank_slots(args, r, world_size)]
    end, rounds, seconds = consumed + P, 0, [0.0, 0.0]
    while True:
        rounds += 1
        indices = [stream_index(p, args.seed, len(train_data)) for p in positions]
        prompts = [train_data[i][0] for i in indices]
        seeds = [args.seed * 10**9 + p * G for p in positions]  # spaced by G: vLLM seeds sample k with seed + k
        t0 = time.time()
        samples = sample(prompts, seeds)
        seconds[0] += time.time() - t0
        # (batch_decode of no sequences returns one empty text: a rollout rank may generate for no trainer)
        texts = tokenizer.batch_decode([s.ids for s in samples], skip_special_tokens=True) if samples else []
        t0 = time.time()
        graded = grade_all(texts, [train_data[indices[k // G]][1] for k in range(len(texts))], grading_workers)
        seconds[1] += time.time() - t0
        limits = (args.max_response_length, args.overlong_buffer_len, args.overlong_penalty_factor)
        rewards = [r + overlong_penalty(len(s.ids), *limits) for (r, _), s in zip(graded, samples)]
        for g, p in enumerate(positions):
            part = slice(g * G, (g + 1) * G)
            groups[p] = (prompts[g], samples[part], graded[part], rewards[part])
        if not args.filter_groups:
            break
        # the metric's spread per group (acc: the grader's verdict before shaping), every rank's
        metric = [
            [float(r == 1) for r, _ in groups[p][2]] if args.filter_groups_metric == "acc" else groups[p][3]
            for p in positions
        ]
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, [(p, max(m) > min(m)) for p, m in zip(positions, metric)])
        for p, varies in sorted(x for share in shares for x in share):
            (kept if varies else dropped).append(p)
        missing = P - len(kept)
        if missing <= 0 or rounds == args.max_gen_batches:
            break
        n = next_round_size(missing, len(kept), len(kept) + len(dropped), P, world_size)
        positions = [p for r in ranks for p in range(end + r * n // world_size, end + (r + 1) * n // world_size)]
        end += n
    sums = {}
    if not args.filter_groups:
        trained, after = list(range(consumed, consumed + P)), consumed + P
    else:
        fill = dropped[: max(P - len(kept), 0)]  # kept and dropped are in stream order: each round's, sorted, follow
        if fill and 0 in ranks:
            print(
                f"warning: {len(kept)} of {P} groups vary after {rounds} generation rounds (--max-gen-batches); "
                f"{len(fill)} whose rewards are all equal fill the step (zero advantage)",
                file=sys.stderr,
            )
        trained = sorted(kept[:P] + fill)
        after = end if fill else trained[-1] + 1
        sums = {"gen_rounds": rounds, "generated_groups": len(kept) + len(dropped), "filtered": len(dropped)}
        sums["filled"] = len(fill)
    mine = {r: [trained[j] for j in rank_slots(args, r, world_size)] for r in ranks}
    if trained != list(range(consumed, consumed + P)):  # groups move to the ranks that train them
        shares = [None] * dist.get_world_size()
        wanted, needed = set(trained), {p for r in ranks for p in mine[r]}
        payload = {p: (g[0], [tuple(s) for s in g[1]], g[2], g[3]) for p, g in groups.items() if p in wanted}
        dist.all_gather_object(shares, payload)
        Sample = type(next(iter(groups.values()))[1][0]) if groups else tuple  # the script's; sent as plain tuples
        moved = {p: g for share in shares for p, g in share.items() if p in needed}
        groups = {p: (g[0], [Sample(*s) for s in g[1]], g[2], g[3]) for p, g in moved.items()}
    return after, {
        r: Rollout(
            prompts=[groups[p][0] for p in mine[r]],
            samples=[s for p in mine[r] for s in groups[p][1]],
            graded=[x for p in mine[r] for x in groups[p][2]],
            rewards=torch.tensor([groups[p][3] for p in mine[r]], dtype=torch.float32).view(-1, G),
            consumed=after,
            sums=sums if r == 0 else dict.fromkeys(sums, 0),  # rank 0's: summed over ranks with the step's
            seconds=tuple(seconds),
        )
        for r in ranks
    }
