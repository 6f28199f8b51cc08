#!/usr/bin/env python
"""Pretrain or adapt an ELMo biLM on your own text with Accelerate (the same program as `hf-elmo pretrain`).

    python examples/pretrain_elmo.py --train-files 'corpus/train-*.txt' --eval-file corpus/heldout.txt \\
        --build-vocab --min-count 3 --config small --max-steps 100000 --output-dir elmo-news

    # several processes / GPUs, bf16:
    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 examples/pretrain_elmo.py ...

`hf-elmo pretrain` is the documented command; this script is an older name of it (hf_elmo.cli.pretrain_main).
Run with --help for every option; the code is in hf_elmo/pretraining_args.py and hf_elmo/pretraining.py.
"""

import sys

from hf_elmo.cli import pretrain_main


if __name__ == "__main__":
    sys.exit(pretrain_main())
