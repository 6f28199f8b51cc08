#!/usr/bin/env python
"""Convert allenai bilm-tf ELMo files (options.json + weights .hdf5) into a Hugging Face folder.

    python conversion/convert_bilm_tf_to_hf.py --options options.json --weights weights.hdf5 --output elmo-small

The folder holds config.json, model.safetensors, the tokenizer files, a model card with the SHA-256 of the
source files, and the modeling code so that `AutoModel.from_pretrained(folder, trust_remote_code=True)` works
without hf_elmo installed. With `--to-bilm-tf MODEL_DIR` it goes the other way.
"""

import argparse
import logging
import sys

from hf_elmo.cli import add_convert_arguments, handle_sigterm, run_reporting_errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_convert_arguments(parser)
    args = parser.parse_args(argv)
    # Imported after parsing, as hf-elmo convert does: torch and Transformers took --help from 0.3 to 4.5 s.
    from hf_elmo.convert import run_convert

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Without this, SIGTERM would kill the process before it removes its hidden staging folder.
    handle_sigterm()
    return run_reporting_errors(lambda: run_convert(args, parser), "converting")


if __name__ == "__main__":
    sys.exit(main())
