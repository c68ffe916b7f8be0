import math

import pytest
import torch

from nanokv_cli.engine.runner.sampler import Sampler, filter_top_k_top_p
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.engine.sequence import Sequence

VOCAB = 50


def seqs_with(n: int, **params) -> list[Sequence]:
    return [Sequence([1], SamplingParams(**params)) for _ in range(n)]


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def three_way(rows: int) -> torch.Tensor:
    """Logits of the distribution (0.5, 0.3, 0.2) over a 3-token vocabulary."""
    return torch.tensor([0.5, 0.3, 0.2]).log().expand(rows, 3).clone()


def frequencies(tokens: list[int], size: int = 3) -> list[float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=size).float()
    return (counts / len(tokens)).tolist()


def test_temperature_zero_is_argmax():
    logits = random_logits(8)
    assert Sampler()(logits, seqs_with(8, temperature=0.0)) == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_even_when_sampling():
    logits = random_logits(8, seed=1)
    assert Sampler()(logits, seqs_with(8, temperature=1.5, top_k=1)) == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = random_logits(8, seed=2)
    assert (
        Sampler()(logits, seqs_with(8, temperature=1.0, top_p=1e-6)) == logits.argmax(-1).tolist()
    )


def test_mixed_batch_keeps_greedy_rows_greedy():
    torch.manual_seed(0)
    logits = random_logits(6, seed=3)
    seqs = seqs_with(3, temperature=0.0) + seqs_with(3, temperature=5.0)
    tokens = Sampler()(logits, seqs)
    assert tokens[:3] == logits[:3].argmax(-1).tolist()
    assert all(0 <= t < VOCAB for t in tokens[3:])


def test_seed_reproduces_the_stream_whatever_the_batch():
    logits = random_logits(1, seed=4)

    def stream(batch_logits: torch.Tensor, seqs: list[Sequence], row: int) -> list[int]:
        sampler = Sampler()
        return [sampler(batch_logits, seqs)[row] for _ in range(20)]

    alone = stream(logits, seqs_with(1, temperature=1.0, seed=123), 0)
    # The same request in a batch, behind unseeded rows that consume the global generator.
    batch = torch.cat([random_logits(3, seed=5), logits])
    crowd = seqs_with(3, temperature=1.0) + seqs_with(1, temperature=1.0, seed=123)
    assert stream(batch, crowd, 3) == alone
    assert len(set(alone)) > 1  # it does sample, not pick the argmax
    assert stream(logits, seqs_with(1, temperature=1.0, seed=124), 0) != alone


def test_forget_restarts_a_seeded_stream():
    logits = random_logits(1, seed=6)
    sampler = Sampler()
    seq = seqs_with(1, temperature=1.0, seed=7)
    first = [sampler(logits, seq)[0] for _ in range(10)]
    sampler.forget(seq[0].seq_id)
    assert [sampler(logits, seq)[0] for _ in range(10)] == first


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"temperature": 1.0}, [0.5, 0.3, 0.2]),
        # temperature 0.5 squares the probabilities: (0.25, 0.09, 0.04) / 0.38
        ({"temperature": 0.5}, [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]),
        ({"temperature": 1.0, "top_k": 2}, [0.625, 0.375, 0.0]),
        # 0.5 + 0.3 reaches 0.7, so the third token is outside the nucleus
        ({"temperature": 1.0, "top_p": 0.7}, [0.625, 0.375, 0.0]),
    ],
)
def test_sampled_frequencies_follow_the_distribution(params, expected):
    torch.manual_seed(0)
    rows = 4000
    tokens = Sampler()(three_way(rows), seqs_with(rows, **params))
    observed = frequencies(tokens)
    for p, q in zip(observed, expected):
        # 5 standard deviations of a binomial proportion (exactly zero stays zero)
        assert abs(p - q) <= 5 * math.sqrt(q * (1 - q) / rows) + (0 if q == 0 else 1e-3)


def test_filter_is_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 3)
    out = filter_top_k_top_p(logits, [2, 0, 3], [1.0, 1.0, 1.0])
    assert torch.isinf(out).sum(-1).tolist() == [2, 0, 1]
    # softmax([4, 3, 2, 1]) = (0.64, 0.24, 0.09, 0.03): top_p 0.5 keeps one, 0.8 two, 1.0 all
    out = filter_top_k_top_p(logits, [0, 0, 0], [0.5, 0.8, 1.0])
    assert torch.isfinite(out).sum(-1).tolist() == [1, 2, 4]
    assert torch.equal(out[torch.isfinite(out)], torch.tensor([4.0, 4.0, 3.0, 4.0, 3.0, 2.0, 1.0]))
    # top-k and top-p together: the stricter wins per row
    out = filter_top_k_top_p(logits[:2], [1, 3], [0.99, 0.5])
    assert torch.isfinite(out).sum(-1).tolist() == [1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_maximum_and_refuses_nan_and_infinity(dtype):
    """float32 CPU rows take numpy's argmax, others torch's: both keep torch's rule (ties go to
    the first index) and a NaN or infinity anywhere in a row stops the run."""
    from nanokv_cli.engine.runner.sampler import NonFiniteLogitsError

    logits = random_logits(8).round().to(dtype)  # rounding makes ties
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1
    expected = [int(i) for i in logits.float().argmax(-1)]
    assert expected[3] == 7
    assert Sampler()(logits, seqs_with(8, temperature=0.0)) == expected
    for bad in (float("nan"), float("inf")):
        broken = logits.clone()
        broken[5, 2] = bad
        with pytest.raises(NonFiniteLogitsError, match="non-finite"):
            Sampler()(broken, seqs_with(8, temperature=0.0))
