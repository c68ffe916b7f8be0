"""Token sampling: greedy, temperature, top-k, top-p, and per-request seeds.

A row is sampled by inverse transform: one uniform number, located in the row's cumulative
distribution. That is one random draw per sampled token instead of one per vocabulary entry
(the exponential-race trick measured ~10x slower on a CPU for a 49k vocabulary: 100 vs 10 ms
at batch 64). Rows without a
seed draw together from torch's global generator; a seeded request owns a ``torch.Generator``
(kept here by ``seq_id`` until ``forget``), so its tokens do not depend on which other requests
share its batches.

Every step checks that each row's largest logit is finite, cheaply (greedy rows: the value at
the argmax, which NaN wins), so a model that computes NaN (NaN weights, a float16 overflow)
fails with a message instead of emitting token 0 to the end.
"""

from collections.abc import Sequence as Seq

import numpy
import torch

from ..sequence import Sequence


class NonFiniteLogitsError(ValueError):
    """The model computed NaN or infinite logits: its weights hold them, or a value overflowed."""


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's generator."""
        self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        """One token per row of ``logits`` [len(seqs), vocab], following each seq's parameters."""
        rows = [i for i, s in enumerate(seqs) if s.temperature > 0 and s.top_k != 1]
        if not rows:
            return greedy(logits, seqs)
        check_finite(logits.amax(-1), seqs)
        if len(rows) == len(seqs):
            return self._sample(logits.float(), list(seqs)).tolist()
        tokens = logits.argmax(-1)
        index = torch.tensor(rows, device=logits.device)
        sampled = self._sample(logits.index_select(0, index).float(), [seqs[i] for i in rows])
        return tokens.index_copy_(0, index, sampled).tolist()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperatures = torch.tensor([s.temperature for s in seqs], device=logits.device)
        logits = filter_top_k_top_p(
            logits / temperatures.unsqueeze(1),
            [s.top_k for s in seqs],
            [s.top_p for s in seqs],
        )
        cdf = torch.softmax(logits, dim=-1).cumsum_(-1)
        u = torch.rand(len(seqs), 1, device=cdf.device)
        for row, seq in enumerate(seqs):
            if seq.seed is not None:
                u[row] = torch.rand(
                    1, generator=self._generator(seq, cdf.device), device=cdf.device
                )
        # First index whose cumulative mass exceeds u * total; filtered tokens (probability 0)
        # add no mass, so they can never be the first to exceed it. Keeping u clearly below 1
        # stops rounding from pushing u * total up to the total, past the last valid token.
        u.clamp_(max=1.0 - 1e-6)
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
        return picked.squeeze(1).clamp_(max=cdf.shape[-1] - 1)

    def _generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seq.seed)
            self._generators[seq.seq_id] = gen
        return gen


def greedy(logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
    """Each row's argmax, checked finite. A float32 CPU row goes through numpy: its argmax
    is ~14x faster than torch's on one thread (49k vocabulary: 11 vs 151 µs at 1 row, 0.67 vs
    8.2 ms at 64; scripts/BENCHMARKS.md, issue #32). Both return the first maximum and let
    NaN win, so the tokens and the finiteness check are the same either way."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        rows = logits.detach().numpy()
        tokens = rows.argmax(-1)
        row_max = rows[numpy.arange(len(tokens)), tokens]
        # numpy's check, torch's only to name the bad row: right after a decode step has
        # streamed the weights through the caches, torch's isfinite and all() took ~80 µs
        # (~15 µs on their own)
        if not numpy.isfinite(row_max).all():
            check_finite(torch.from_numpy(row_max), seqs)
        return tokens.tolist()
    tokens = logits.argmax(-1)
    check_finite(logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), seqs)
    return tokens.tolist()


def check_finite(row_max: torch.Tensor, seqs: Seq[Sequence]) -> None:
    """Raise NonFiniteLogitsError unless every row's largest logit (``row_max``) is finite:
    a NaN anywhere in a row makes its maximum NaN."""
    finite = torch.isfinite(row_max)
    if bool(finite.all()):
        return
    bad = seqs[int((~finite).nonzero()[0])]
    raise NonFiniteLogitsError(
        f"the model computed non-finite logits (NaN or infinity) for request {bad.seq_id}: "
        "its weights hold NaN or infinite values, or a value overflowed (with float16 or "
        "bfloat16, try --dtype float32)"
    )


def filter_top_k_top_p(
    logits: torch.Tensor, top_ks: list[int], top_ps: list[float]
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k (0 = off) and top-p nucleus (1 = off)."""
    vocab = logits.shape[-1]
    use_k = any(0 < k < vocab for k in top_ks)
    use_p = any(p < 1.0 for p in top_ps)
    if not (use_k or use_p):
        return logits
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    if not use_p:
        # top-k alone needs only the k-th largest value per row, not a full sort.
        top = logits.topk(int(ks.max()), dim=-1).values
        threshold = top.gather(-1, (ks - 1).unsqueeze(1))
        return logits.masked_fill(logits < threshold, float("-inf"))
    ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    ordered = ordered.masked_fill(rank >= ks.unsqueeze(1), float("-inf"))
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    ps = torch.tensor(top_ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    # A token is outside the nucleus when the tokens ranked above it already reach top_p;
    # the top token never is.
    ordered = ordered.masked_fill(mass_before > ps, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, ordered)
