"""A two-step Trainer run of a token-classification head on the CoNLL fixture, for comparing set-ups.

`tests/test_heads.py` runs it in-process (one process, one large batch) and under `accelerate launch` with two CPU
processes and gradient accumulation (`python -m accelerate.commands.accelerate_cli launch ... token_training.py
FOLDER CONLL OUTPUT PER_DEVICE ACCUMULATION`): both must end with the same weights.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    Trainer,
    TrainingArguments,
)

import hf_elmo  # noqa: F401
from hf_elmo.finetuning import build_label_map, read_conll


def train(folder, conll, output, per_device: int, accumulation: int) -> dict[str, torch.Tensor]:
    """Four sentences (7, 7, 3 and 1 labelled words) make one optimiser step; two steps; SGD; mix penalty on."""
    sentences = read_conll(conll)
    id2label = build_label_map([t for s in sentences for t in s.tags], outside="O")
    label2id = {label: i for i, label in id2label.items()}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    features = [{**tokenizer(s.words, is_split_into_words=True), "labels": [label2id[t] for t in s.tags]}
                for s in sentences]
    features += [{key: value[:length] for key, value in features[0].items()} for length in (3, 1)]
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(folder, id2label=id2label, label2id=label2id,
                                                            mix_dropout=0.0, mix_l2_coef=0.5)
    args = TrainingArguments(
        os.path.join(output, "trainer"), per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation, max_steps=2, optim="sgd", learning_rate=0.5,
        lr_scheduler_type="constant", report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1000,
        seed=0, use_cpu=True, ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=features,
                      data_collator=DataCollatorForTokenClassification(tokenizer))
    trainer.train()
    weights = {name: p.detach().clone().contiguous() for name, p in model.state_dict().items()}
    if trainer.is_world_process_zero():
        save_file(weights, os.path.join(output, "weights.safetensors"))
        with open(os.path.join(output, "run.json"), "w") as f:
            json.dump({"world_size": args.world_size, "per_device": per_device, "accumulation": accumulation}, f)
    return weights


if __name__ == "__main__":
    folder, conll, output, per_device, accumulation = sys.argv[1:6]
    train(folder, conll, output, int(per_device), int(accumulation))
    if torch.distributed.is_initialized():
        # Both processes tear the gloo group down together, as `hf-elmo pretrain` does, rather than at interpreter
        # exit while the other may still be saving: CI once saw rank 1 abort ("terminate called without an active
        # exception") with its last output the loading messages, which is also what a teardown abort would leave
        # (stdout is block-buffered into the pipe). Not confirmed: 60 launches in a row passed here before this.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
