"""The sampled softmax's loss over its (positions x negatives) scores, with a hand-written backward.

Those scores are a pretraining step's largest tensor (64 sentences x 8192 negatives: about 100 MB), and every pass
over it costs: written with autograd (bias add, `logsumexp`, their backwards) the step made five more tensors of
its size and passed over them nine times. Here it is allocated once, by the matmul, and turned in place into
unnormalised probabilities (four passes) and then into its own gradient (two), besides the three matmuls. The
maths is the plain formula's, `-log_softmax([true, sampled])[0]`, as the tests check with gradients.
"""

import torch


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
        scores = (hidden @ sampled_weight.t()).float()  # in bf16, one fp32 copy; in fp32 the product itself
        scores.add_(sampled_shift)
        rows = torch.arange(len(scores), device=scores.device)
        scores.index_put_((rows, hit_columns), hit_values, accumulate=True)
        top = torch.maximum(scores.amax(dim=1), true_logits)
        probabilities = scores.sub_(top[:, None]).exp_()  # unnormalised: divided by `total` in the backward
        true_probability = (true_logits - top).exp()
        total = probabilities.sum(dim=1) + true_probability
        ctx.save_for_backward(hidden, sampled_weight, probabilities, true_probability, total)
        return top + total.log() - true_logits

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, sampled_weight, probabilities, true_probability, total = ctx.saved_tensors
        scale = grad_loss / total
        grad_scores = probabilities.mul_(scale[:, None])  # d loss / d score = its softmax probability
        grad_shift = grad_scores.sum(dim=0)
        grad_scores = grad_scores.to(hidden.dtype)
        grad_hidden = grad_scores @ sampled_weight
        grad_weight = grad_scores.t() @ hidden
        grad_true_logits = true_probability * scale - grad_loss
        return grad_hidden, grad_weight, grad_shift, grad_true_logits, None, None
