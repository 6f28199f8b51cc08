"""Two optimizer steps of the captured pretraining step, for comparing set-ups, and the helpers its tests share.

`tests/test_captured_step.py` runs `train` in-process (one process: both halves of each global batch as two
accumulated micro-batches) and under `accelerate launch` with two CPU processes (`python -m
accelerate.commands.accelerate_cli launch ... captured_training.py OUTPUT`: rank r takes half r, and the gradient
buffer is all-reduced between the two graphs). Both must end with the same weights: the mean over processes of
each process's mean loss gradient, as bilm-tf averages its GPUs' gradients.
"""

import os
import sys

import torch
from safetensors.torch import save_file

from hf_elmo import ElmoConfig, ElmoForPreTraining
from hf_elmo.captured_step import CapturedTrainingStep
from hf_elmo.pretraining import COMPILED_LENGTH_BUCKET
from hf_elmo.pretraining_data import BatchEncoder


TINY = {"char_filters": [[1, 4], [2, 4], [3, 8]], "n_highway": 1, "char_embedding_dim": 4, "lstm_dim": 24,
        "projection_dim": 8, "num_lstm_layers": 2, "cell_clip": 3.0, "proj_clip": 3.0}
WORDS = [f"w{i}" for i in range(297)]
VOCAB = ["<S>", "</S>", "<UNK>", *WORDS]
# Each step's two halves: 4 and 3 sentences of different lengths (so that the halves' means weigh their words
# unequally), all in one length bucket of 8 words with <S> and </S> (one short graph to trace).
HALVES = [([5, 3, 6, 1], [4, 4, 2]), ([6, 5, 2, 2], [3, 6, 1])]


def sentences(lengths, offset=0) -> list[list[str]]:
    return [[WORDS[(offset + 7 * i + 13 * j) % len(WORDS)] for j in range(n)] for i, n in enumerate(lengths)]


def encode(lengths, rows=5, offset=0) -> dict:
    """A batch as `hf-elmo pretrain` gives the captured step: `rows` rows, a multiple of 8 words."""
    batch = BatchEncoder(VOCAB, pad_to_multiple_of=COMPILED_LENGTH_BUCKET, pad_rows_to=rows)(sentences(lengths, offset))
    del batch["num_tokens"]
    return batch


def pretraining_model(dropout=0.1, samples=64) -> ElmoForPreTraining:
    torch.manual_seed(0)
    return ElmoForPreTraining(ElmoConfig(**TINY, vocab_size=len(VOCAB), num_softmax_samples=samples,
                                         lm_dropout=dropout)).train()


def adagrad(model):
    return torch.optim.Adagrad(model.parameters(), lr=0.2, initial_accumulator_value=1.0)


def train(rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
    """Full softmax, no dropout: nothing random, so one process and two see the same numbers."""
    model = pretraining_model(dropout=0.0, samples=0)
    step = CapturedTrainingStep(model, adagrad(model), loss_scale=20.0, max_grad_norm=10.0, largest_batch=(5, 8),
                                accumulation_steps=2 // world_size, world_size=world_size, backend="aot_eager")
    for index, halves in enumerate(HALVES):
        batches = [encode(lengths, offset=10 * index + half) for half, lengths in enumerate(halves)]
        for batch in batches if world_size == 1 else [batches[rank]]:
            step.accumulate(batch)
        step.all_reduce()
        step.update()
    return {name: p.detach().clone().contiguous() for name, p in model.state_dict().items()}


if __name__ == "__main__":
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    weights = train(accelerator.process_index, accelerator.num_processes)
    if accelerator.is_main_process:
        save_file(weights, os.path.join(sys.argv[1], f"weights-{accelerator.num_processes}.safetensors"))
    # Both processes tear the gloo group down together (see token_training.py).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
