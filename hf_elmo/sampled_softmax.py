"""bilm-tf's sampled softmax for `ElmoForPreTraining` (`sampled_softmax_losses`), its loss over the (positions x
negatives) scores with a hand-written backward, and the softmax rows' sparse gradients. Comes with `pip install
hf-elmo`, not with a saved folder's code.

The scores are a pretraining step's largest tensor (64 sentences x 8192 negatives: about 100 MB), and every pass
over it costs: written with autograd (bias add, `logsumexp`, their backwards) the step made five more tensors of
its size and passed over them nine times. Here it is allocated once, by the matmul, and turned in place into
unnormalised probabilities (four passes) and then into its own gradient (two), besides the three matmuls. The
maths is the plain formula's, `-log_softmax([true, sampled])[0]`, as the tests check with gradients.
"""

import torch
from torch import nn

from . import log_uniform_sampler
from .cpu_tuning import matmul, onednn_multiplies, padded_rows

# Rows of scores that one oneDNN product computes (`SampledSoftmaxLoss.forward`): 8 MB of scores for 8192 negatives.
SCORE_BLOCK_ROWS = 256


class SampledSoftmaxLoss(torch.autograd.Function):
    """
    Per-position loss `logsumexp([true_logits, scores]) - true_logits` where `scores = hidden @ sampled_weight.T +
    sampled_shift`, with `hit_values` added at `(every row, hit_columns)` (-inf where a negative is the row's own
    target, 0 elsewhere).

    `hidden` `(positions, dim)` and `sampled_weight` `(negatives, dim)` in the matmul dtype; `sampled_shift`
    `(negatives,)` (bias minus log expected count) and `true_logits` `(positions,)` in fp32, as are the scores and
    the loss. Gradients flow to those four. The scores are overwritten by the backward, which therefore runs once
    (a second `backward` through the same graph raises autograd's in-place modification error).
    """

    @staticmethod
    def forward(ctx, hidden, sampled_weight, sampled_shift, true_logits, hit_columns, hit_values):
        positions = len(hidden)
        onednn = onednn_multiplies(hidden, hidden.numel() * len(sampled_weight))
        padded = padded_rows(positions) if onednn else positions
        if padded == positions:
            padded_scores = (hidden @ sampled_weight.t()).float()  # in bf16, one fp32 copy; in fp32 the product
        else:
            # The products go to oneDNN (`cpu_tuning.matmul`), on its padded row count: the scores get it at once,
            # zero rows past the positions, so that the backward's products need no padded copy of them. oneDNN
            # returns a new tensor, and one of the scores' size at each step left glibc's kept heap 1.6 GiB larger
            # (benchmarks/README.md): the scores are computed in blocks of rows, each copied into them.
            hidden = nn.functional.pad(hidden, (0, 0, 0, padded - positions))
            padded_scores = hidden.new_empty(padded, len(sampled_weight))
            for block in range(0, padded, SCORE_BLOCK_ROWS):
                part = slice(block, block + SCORE_BLOCK_ROWS)
                padded_scores[part] = matmul(hidden[part], sampled_weight.t())
        scores = padded_scores[:positions]
        scores.add_(sampled_shift)
        rows = torch.arange(positions, device=scores.device)
        scores.index_put_((rows, hit_columns), hit_values, accumulate=True)
        top = torch.maximum(scores.amax(dim=1), true_logits)
        scores.sub_(top[:, None]).exp_()  # unnormalised probabilities: divided by `total` in the backward
        true_probability = (true_logits - top).exp()
        total = scores.sum(dim=1) + true_probability
        ctx.save_for_backward(hidden, sampled_weight, padded_scores, true_probability, total)
        return top + total.log() - true_logits

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, sampled_weight, padded_probabilities, true_probability, total = ctx.saved_tensors
        positions = len(total)
        scale = grad_loss / total
        # d loss / d score = its softmax probability (the padding rows stay zero)
        grad_shift = padded_probabilities[:positions].mul_(scale[:, None]).sum(dim=0)
        grad_scores = padded_probabilities.to(hidden.dtype)
        grad_hidden = matmul(grad_scores, sampled_weight)[:positions]
        grad_weight = matmul(grad_scores.t(), hidden)
        grad_true_logits = true_probability * scale - grad_loss
        return grad_hidden, grad_weight, grad_shift, grad_true_logits, None, None


class _RowsWithSparseGradient(torch.autograd.Function):
    """`table[ids]` whose gradient is a sparse tensor holding only the rows `ids` names (duplicates summed when it
    is coalesced). `nn.functional.embedding(..., sparse=True)` does this for 2-D tables only; the bias is 1-D."""

    @staticmethod
    def forward(ctx, table, ids):
        ctx.save_for_backward(ids)
        ctx.table_shape = table.shape
        return table[ids]

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return torch.sparse_coo_tensor(ids[None], grad, ctx.table_shape, check_invariants=False), None


def rows_for_training(softmax, ids: torch.Tensor):
    """
    `ElmoSoftmax.rows` where a step's gradient, norm and Adagrad update touch only these rows. With `softmax.sparse`
    the rows' gradients are sparse tensors. With `softmax.keep_gathered` (the captured training step, whose shapes
    must not depend on the data) the gathered rows are kept, while autograd records, in `softmax.gathered` as `(ids,
    weight rows, biases)`: the step asks autograd for their gradient alone and updates those rows alone.
    """
    if softmax.keep_gathered:
        rows = softmax.weight[ids], softmax.bias[ids]
        if torch.is_grad_enabled():
            softmax.gathered = (ids, *rows)
        return rows
    return rows_with_sparse_gradient(softmax.weight, softmax.bias, ids)


def rows_with_sparse_gradient(weight: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor):
    """The rows' sparse gradients (`rows_for_training`; what the `ElmoSoftmax.rows` of earlier saved folders call)."""
    return _RowsWithSparseGradient.apply(weight, ids), _RowsWithSparseGradient.apply(bias, ids)


def sampled_softmax_losses(softmax, hidden: torch.Tensor, targets: torch.Tensor, num_samples: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """
    Per-position losses (0 where the target is -100) of bilm-tf's sampled softmax over `softmax` (an `ElmoSoftmax`):
    `num_samples` log-uniform negatives shared by every position, the expected-count correction, and accidental
    hits removed. `dtype` is the matmul dtype (the hand-written backward multiplies in the forward's dtype).
    """
    vocab_size = softmax.num_embeddings
    sampler = log_uniform_sampler
    candidates, num_tries = sampler.sample_log_uniform_candidates(num_samples, vocab_size, device=targets.device)
    keep = targets != -100
    targets = targets.clamp(min=0)  # ignored positions compute something finite, then count for nothing
    log_q_sampled = sampler.log_uniform_expected_count(candidates, vocab_size, num_samples, num_tries).log()
    log_q_true = sampler.log_uniform_expected_count(targets, vocab_size, num_samples, num_tries).log()
    # One gather for the targets and the negatives: with sparse gradients, one sparse tensor per parameter.
    weight, bias = softmax.rows(torch.cat([targets, candidates]))
    true_weight, sampled_weight = weight.split([len(targets), num_samples])
    true_bias, sampled_bias = bias.split([len(targets), num_samples])
    # The products in the matmul dtype; bias and correction added in fp32 (in bf16 the correction, up to ~13,
    # would be rounded to 1/16).
    true_logits = (hidden * true_weight).sum(-1).float() + (true_bias.float() - log_q_true.float())
    sampled_shift = sampled_bias.float() - log_q_sampled.float()
    # A negative that happens to be the target would be counted against itself. The candidates are distinct, so
    # a target is at most one of them: found by binary search in the sorted candidates, and given -inf (0 added
    # elsewhere: a write of static shape, no host sync).
    sorted_candidates, order = candidates.sort()
    slot = torch.searchsorted(sorted_candidates, targets).clamp_(max=num_samples - 1)
    hit = sorted_candidates[slot] == targets
    hit_values = torch.where(hit, float("-inf"), 0.0)
    losses = SampledSoftmaxLoss.apply(hidden.to(dtype), sampled_weight.to(dtype), sampled_shift, true_logits,
                                      order[slot], hit_values)
    return losses * keep
