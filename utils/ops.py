"""Generic tensor operations the method scripts call where torch's own is slow or limited; they know no method."""

import math

import torch


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(x, q) of a 1-D tensor (linear interpolation, the same float operations) without its limit of
    2^24 elements, which a mini-batch of a large run exceeds."""
    pos = torch.tensor(q, dtype=x.dtype, device=x.device) * (x.numel() - 1)
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


def entropy_above_kth(logits: torch.Tensor, k: int, block: int | None = None) -> torch.Tensor:
    """H_S of each row of logits [N, V]: the entropy of the softmax renormalised over the set S of its logits above its
    k-th smallest (AEnt's clamped entropy, k = floor(clamp_p V)), differentiable w.r.t. the kept logits; logits tied
    with the threshold share the kept mass evenly. Computed in equal blocks of whole rows of at most ~`block` elements
    (default: 1M on a CPU, where a block's passes stay in the cache and cost ~20 thread synchronisations, not ~18 a
    row; 16M elsewhere), keeping per-row scalars only."""
    n, vocab = logits.shape[0], logits.shape[-1]
    block = block or (1 << 20 if logits.device.type == "cpu" else 1 << 24)
    blocks = max(1, -(-n * vocab // block))
    return _EntropyAboveKth.apply(logits, k, max(1, -(-n // blocks)))


class _EntropyAboveKth(torch.autograd.Function):
    """H_S row block by row block (entropy_above_kth). Clamping the logits at the threshold t (the k-th smallest) puts
    the k dropped ones at t, so their mass is known, k e^t, and subtracted: no top-k indices. Only per-row scalars are
    saved; the backward recomputes the kept softmax from the logits. On a CPU every operation on more than 32k
    elements is a parallel region, a synchronisation of torch's threads (which stalls when the cores are
    oversubscribed): blocks of whole rows, ~20 such operations each; float 0/1 masks, not `where` or -inf (their CPU
    kernels are several times slower)."""

    @staticmethod
    def forward(ctx, logits, k: int, rows: int):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        # per row: threshold, max, log kept mass, H_S
        stats = torch.empty((logits.shape[0], 4), dtype=dtype, device=logits.device)
        for z, out in zip(logits.split(rows), stats.split(rows)):
            z = z.to(dtype)
            t = kth_smallest(z, k) if k else z.amin(dim=-1, keepdim=True) - 1
            m = z.amax(dim=-1, keepdim=True)
            d = torch.maximum(z, t).sub_(m)
            e = d.exp()
            dropped = k * (t - m).exp()
            total = e.sum(dim=-1, keepdim=True) - dropped
            expected_d = (torch.linalg.vecdot(e, d)[:, None] - dropped * (t - m)) / total
            torch.cat([t, m, total.log(), total.log() - expected_d], dim=1, out=out)
        ctx.save_for_backward(logits, stats)
        ctx.k, ctx.rows = k, rows
        return stats[:, 3].clone()

    @staticmethod
    def backward(ctx, grad_entropy):
        logits, stats = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for z, s, g, out in zip(*(x.split(ctx.rows) for x in (logits, stats, grad_entropy, grad))):
            z = z.to(s.dtype)
            t, m, log_total, entropy = s[:, :, None].unbind(1)
            g = -g[:, None].to(s.dtype)
            above = torch.gt(z, t, out=torch.empty_like(z))  # 1 where z > t
            d = torch.maximum(z, t).sub_(m + log_total)  # log q_i on the kept set (clamped: exp cannot underflow)
            d_entropy = torch.addcmul(g * entropy, d, g).mul_(above)  # -g (log q_i + H) on the kept set, else 0
            torch.mul(d.exp_(), d_entropy, out=out)  # times q_i: g dH/dz_i = -g q_i (log q_i + H)
            tied_kept = z.shape[-1] - ctx.k - above.sum(dim=-1, keepdim=True)  # logits equal to t that are kept
            if (tied_kept > 0).any():  # they share the kept mass evenly (same value as keeping any of them)
                tied = z == t
                log_q_t = t - m - log_total
                out.add_(tied * (g * log_q_t.exp() * (log_q_t + entropy) * tied_kept / tied.sum(dim=-1, keepdim=True)))
        return grad, None, None
