#!/usr/bin/env python
"""Export an hf_elmo model folder as bilm-tf files: options.json + weights.hdf5 (+ vocab.txt).

    python conversion/convert_hf_to_bilm_tf.py MODEL_DIR --output elmo-bilm-tf

MODEL_DIR is any folder written by hf_elmo's `save_pretrained`: a converted model, a pretraining run's output
(`ElmoForPreTraining`: only the biLM is exported, as bilm-tf's weight files never hold the softmax) or a task model.
The weights are written in float32 with bilm-tf's dataset names and layouts, so converting the export back with
convert_bilm_tf_to_hf.py gives bit-identical weights. A word vocabulary saved with the model (vocab.txt) is copied
along; it is already in bilm-tf's format.
"""

import argparse
import logging
import os
import sys

from hf_elmo.cli import ERROR_EXIT, handle_sigterm, run_reporting_errors
from hf_elmo.convert import convert_hf_to_bilm_tf


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="hf_elmo model folder (config.json + model.safetensors).")
    parser.add_argument("--output", required=True, help="folder to write; created atomically.")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it is a bilm-tf export or "
                        "model folder this tool wrote; never MODEL_DIR or the current folder.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        print(f"error: {args.model_dir} is not an hf_elmo model folder (no config.json).", file=sys.stderr)
        return ERROR_EXIT
    handle_sigterm()
    return run_reporting_errors(lambda: _export(args), "exporting")


def _export(args) -> int:
    written = convert_hf_to_bilm_tf(args.model_dir, args.output, overwrite=args.overwrite)
    logging.getLogger("convert_hf_to_bilm_tf").info("Wrote %s", ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
