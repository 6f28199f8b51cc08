"""Negative candidates for the sampled softmax: TensorFlow's `log_uniform_candidate_sampler(unique=True)`.

Word ids are drawn from the log-uniform (Zipfian) distribution `P(k) = log((k + 2) / (k + 1)) / log(V + 1)` until
`S` distinct ids are seen; the candidates are those ids in order of first draw, and the number of draws it took
enters the expected counts that correct the logits.

TensorFlow draws until it has enough, a loop whose length depends on the draws. Here the draws are a fixed-size
pool, sized once per `(S, V)` so that the pool holds `S` distinct ids except with negligible probability, and the
first `S` distinct ids are picked with tensor operations: the same distribution, with static shapes and no host
sync, on whatever device the random generator lives on (its state is part of every checkpoint, so a resumed run
replays the same candidates).
"""

import functools
import math

import torch


# A function of two integers: traced as the constant it returns (its host-side search never enters a graph).
@torch.compiler.assume_constant_result
def pool_size(num_samples: int, vocab_size: int) -> int:
    """Draws per pool for `num_samples` distinct ids out of `vocab_size` (see `_search_pool_size`); cached."""
    return _search_pool_size(num_samples, vocab_size)


@functools.lru_cache(maxsize=16)
def _search_pool_size(num_samples: int, vocab_size: int) -> int:
    """
    Draws per pool: the smallest count whose expected number of distinct ids exceeds `num_samples` by eight
    standard deviations (plus one), so that a pool short of distinct ids is a probability below 1e-15. The
    distinct count is a sum of negatively correlated indicators, so their variances bound its variance.
    """
    ids = torch.arange(vocab_size, dtype=torch.float64)
    probability = (torch.log(ids + 2) - torch.log(ids + 1)) / math.log(vocab_size + 1)
    log_miss = torch.log1p(-probability)

    def enough(draws: int) -> bool:
        seen = -torch.expm1(draws * log_miss)
        mean, variance = float(seen.sum()), float((seen * (1 - seen)).sum())
        return mean - num_samples >= 8 * math.sqrt(variance) + 1

    low, high = num_samples, num_samples
    while not enough(high):
        low, high = high, 2 * high
        if high > 1 << 40:
            raise ValueError(f"cannot draw {num_samples} distinct ids from a vocabulary of {vocab_size}.")
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if not enough(middle) else (low, middle)
    return high


def sample_log_uniform_candidates(
    num_samples: int, vocab_size: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    `num_samples` distinct word ids in order of first draw, and the number of draws it took to see them (a
    0-dim tensor), drawn with `generator` (the device's default generator when None).
    """
    draws = pool_size(num_samples, vocab_size)
    uniform = torch.rand(draws, dtype=torch.float64, device=device, generator=generator)
    ids = (torch.exp(uniform * math.log(vocab_size + 1)).long() - 1).clamp_(0, vocab_size - 1)
    order = torch.arange(draws, device=device)
    first_draw = torch.full((vocab_size,), draws, device=device).scatter_reduce(0, ids, order, reduce="amin")
    is_first = first_draw[ids] == order
    distinct_so_far = is_first.cumsum(0)
    torch._assert_async(distinct_so_far[-1] >= num_samples, "log-uniform pool too small: draw again")
    keep = is_first & (distinct_so_far <= num_samples)
    slot = torch.where(keep, distinct_so_far - 1, num_samples)  # the slot past the end takes everything else
    candidates = ids.new_zeros(num_samples + 1).scatter_(0, slot, ids)[:num_samples]
    # The draw that brings the S-th distinct id is the last one TensorFlow would have made.
    num_tries = (distinct_so_far < num_samples).sum() + 1
    return candidates, num_tries


def log_uniform_expected_count(
    ids: torch.Tensor, vocab_size: int, num_samples: int, num_tries: torch.Tensor | int
) -> torch.Tensor:
    """Expected number of times each id appears among the samples: TensorFlow's `ExpectedCountHelper`."""
    ids = ids.to(torch.float64)
    probability = (torch.log(ids + 2) - torch.log(ids + 1)) / math.log(vocab_size + 1)
    num_tries = torch.as_tensor(num_tries, dtype=torch.float64, device=ids.device)
    # When nothing repeated, TensorFlow uses the plain expectation.
    return torch.where(
        num_tries == num_samples, probability * num_samples, -torch.expm1(num_tries * torch.log1p(-probability))
    )
