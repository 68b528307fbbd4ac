"""Generic tensor operations the method scripts call where torch's own is slow or limited; they know no method."""

import math

import torch


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(x, q) of a 1-D tensor (linear interpolation, the same float operations) without its limit of
    2^24 elements, which a mini-batch of a large run exceeds."""
    pos = x.new_full((), q) * (x.numel() - 1)  # filled on x's device: not a copy from the host (a GPU sync)
    values = x.sort().values
    return values[pos.long()].lerp(values[pos.ceil().long()], pos - pos.long())


def kth_smallest(z: torch.Tensor, k: int) -> torch.Tensor:
    """torch.kthvalue(z, k, dim=-1, keepdim=True).values for z [R, V], cheaper on a CPU, whose quickselect costs a
    mispredicted branch per element and pass (~2 ms a row at V = 152k): a strided sample brackets each row's k-th value,
    one vectorised pass counts the values below the bracket, and kthvalue finishes on the ~7% inside it. A row whose
    bracket misses it (the sample off by over 5 binomial standard deviations) falls back to its whole row."""
    sample = z[:, ::32]
    rank = k * sample.shape[1] / z.shape[1]  # the k-th value's expected rank in the sample
    spread = 5 * math.sqrt(rank * (1 - k / z.shape[1])) + 1
    low, high = math.floor(rank - spread), math.ceil(rank + spread)
    if not z.is_cpu or low < 1 or high > sample.shape[1]:  # (on a GPU, kthvalue is a radix select already)
        return z.kthvalue(k, dim=-1, keepdim=True).values
    lo = sample.kthvalue(low, dim=-1, keepdim=True).values
    hi = sample.kthvalue(high, dim=-1, keepdim=True).values
    below = torch.lt(z, lo, out=torch.empty_like(z))  # float 0/1 masks: compared and summed faster than bool ones
    inside = torch.le(z, hi, out=torch.empty_like(z)).sub_(below)
    ranks = (k - below.sum(dim=-1)).long().tolist()  # the k-th value's rank among the row's values inside
    pieces = z[inside.bool()].split(inside.sum(dim=-1).long().tolist())
    t = torch.empty_like(lo)
    for row, (piece, j) in enumerate(zip(pieces, ranks)):
        t[row] = piece.kthvalue(j).values if 1 <= j <= len(piece) else z[row].kthvalue(k).values
    return t
