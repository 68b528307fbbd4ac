"""A step's samples as micro-batches: which samples go together (fixed counts or a token budget), and their collation
into padded or packed rows."""

import torch
import torch.distributed as dist

from . import distributed


def micro_batches(sizes: list, args, device):
    """This rank's micro-batches, as lists of sample indices (`sizes`: each sample's prompt + response tokens), and
    the range of them that makes each optimizer mini-batch. Mini-batch m holds samples [m L, (m + 1) L), L = samples /
    --num-mini-batches, split into --micro-batch-size consecutive samples; or, with --max-tokens-per-micro-batch N,
    into as few groups of at most N tokens as first-fit decreasing finds, padded with empty micro-batches to the most
    any rank needs (every rank runs as many forward and backward passes: ZeRO gathers or reduces in each)."""
    size, budget = len(sizes) // args.num_mini_batches, args.max_tokens_per_micro_batch
    minis = [range(m * size, (m + 1) * size) for m in range(args.num_mini_batches)]
    if not budget:
        groups = [
            [list(mini[s : s + args.micro_batch_size]) for s in range(0, size, args.micro_batch_size)] for mini in minis
        ]
    else:
        groups = []
        for mini in minis:
            bins, loads = [], []
            for k in sorted(mini, key=lambda k: -sizes[k]):  # longest first; a stable sort: ties in sample order
                fit = next((b for b, load in enumerate(loads) if load + sizes[k] <= budget), len(bins))
                if fit == len(bins):
                    bins.append([])
                    loads.append(0)
                bins[fit].append(k)
                loads[fit] += sizes[k]
            groups.append([sorted(b) for b in bins])
        counts = torch.tensor([len(g) for g in groups], device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        groups = [g + [[] for _ in range(int(n) - len(g))] for g, n in zip(groups, counts.tolist())]
    starts = [sum(map(len, groups[:m])) for m in range(len(groups) + 1)]
    return [b for g in groups for b in g], [range(starts[m], starts[m + 1]) for m in range(len(groups))]


def collate(prompts: list, responses: list, pad_id: int, device, advantages=None, packed=False, index=None) -> dict:
    """Prompt+response sequences, right-padded rows with their attention mask, or `packed`: one row without padding,
    positions restarting per sequence; the response mask and where its tokens' log-probs are read (target_at), the
    response lengths (CPU), given one advantage per
    sequence each response token's, and `index` (the samples' positions in the step). No sequences: a one-token row
    without response (an empty micro-batch)."""
    rows = [p + r for p, r in zip(prompts, responses)] or [[pad_id]]
    masks = [[False] * len(p) + [True] * len(r) for p, r in zip(prompts, responses)] or [[False]]
    positions = [list(range(len(row))) for row in rows]
    if packed:
        rows, masks, positions = ([[x for row in part for x in row]] for part in (rows, masks, positions))
    width = max(map(len, rows))

    def padded(values: list, fill) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values])

    batch = {"input_ids": padded(rows, pad_id), "response_mask": padded(masks, False)}
    # each response token's log-prob is read at the position before it: their flat indices (row x width + column),
    # made here on the CPU, so that the kernel gathers with them and not with a mask (a GPU's nonzero waits for it)
    rows_at, columns_at = batch["response_mask"][:, 1:].nonzero(as_tuple=True)
    batch["target_at"] = rows_at * width + columns_at
    if packed:  # no attention mask: transformers tells the sequences apart by their restarting positions
        batch["position_ids"] = padded(positions, 0)
    else:
        batch["attention_mask"] = padded([[1] * len(row) for row in rows], 0)
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
    batch = {key: tensor.to(device) for key, tensor in batch.items()} | {"lengths": lengths, "index": index}
    if advantages is not None:
        batch["advantages"] = advantages.to(device).repeat_interleave(lengths.to(device))
    return batch


def mini_batch_samples(batches: list, mb: range, counted: torch.Tensor) -> tuple:
    """The response lengths of collated micro-batches `batches[i] for i in mb` in order (CPU), whether each sequence
    counts in the loss (`counted`: the step's, by sample) and each micro-batch's token count: a mini-batch's token
    weights made at once and moved to the device in one copy (a copy per micro-batch waits for the GPU each time)."""
    lengths = [batches[i]["lengths"] for i in mb]
    return torch.cat(lengths), counted[[k for i in mb for k in batches[i]["index"]]], [int(n.sum()) for n in lengths]


def in_sample_order(batches: list, mb: range) -> torch.Tensor:
    """The permutation that puts the concatenated tokens of collated micro-batches `batches[i] for i in mb` in sample
    order (the order of fixed micro-batches), so that a selection over them does not depend on how samples are
    grouped (the Cov methods' global scope)."""
    samples = [torch.tensor(batches[i]["index"], dtype=torch.long).repeat_interleave(batches[i]["lengths"]) for i in mb]
    return torch.cat(samples).argsort(stable=True)


def over_mini_batch(columns: list, batches: list, mb: range, select) -> list:
    """A selection over the optimizer mini-batch of all ranks, the same whatever the micro-batches, packing and world
    size (the global scope of KL-Cov, Clip-Cov and Lp-Reg): `columns`, each a per-token quantity as this rank's flat
    tensors of micro-batches `batches[i] for i in mb`, are put in sample order and gathered over ranks; `select` maps
    the gathered [tokens, len(columns)] to per-token tensors, and each comes back as this rank's part, one tensor per
    micro-batch in its own order."""
    sizes = [len(x) for x in columns[0]]
    local = torch.stack([torch.cat(column) for column in columns], dim=1)
    order = in_sample_order(batches, mb).to(local.device)
    gathered, offset = distributed.gather_ranks(local[order])
    unsort, mine = order.argsort(), slice(offset, offset + len(local))
    return [out[mine][unsort].split(sizes) for out in select(gathered)]
