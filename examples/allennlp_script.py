"""A script written for AllenNLP 0.9, moved to hf_elmo by changing its imports and nothing else.

    python examples/allennlp_script.py                          # the released "original" model (downloads it)
    python examples/allennlp_script.py OPTIONS.json WEIGHTS.hdf5 # any bilm-tf pair, e.g. bilm-tf's test model

Everything below the imports is ordinary AllenNLP 0.9 code: contextual vectors for a task model from `Elmo` and
`batch_to_ids`, and every layer of a sentence from `ElmoEmbedder`. The numbers are AllenNLP's (tests/test_allennlp.py
runs this file and compares it with AllenNLP's own code on the same weights).
"""

import sys

# Before:
#   from allennlp.modules.elmo import Elmo, batch_to_ids
#   from allennlp.commands.elmo import ElmoEmbedder
from hf_elmo.allennlp import Elmo, ElmoEmbedder, batch_to_ids
from hf_elmo.allennlp import DEFAULT_OPTIONS_FILE, DEFAULT_WEIGHT_FILE  # AllenNLP kept these in commands.elmo


options_file, weight_file = sys.argv[1:3] if len(sys.argv) > 2 else (DEFAULT_OPTIONS_FILE, DEFAULT_WEIGHT_FILE)

# Two mixes of the biLM's layers, e.g. one for a tagger's input and one for its output layer.
elmo = Elmo(options_file, weight_file, num_output_representations=2, dropout=0.0)
sentences = [["The", "bank", "raised", "its", "rates", "."], ["She", "sat", "on", "the", "river", "bank", "."]]
character_ids = batch_to_ids(sentences)
output = elmo(character_ids)
representations, mask = output["elmo_representations"], output["mask"]
print("elmo_representations:", [tuple(r.shape) for r in representations], "mask:", tuple(mask.shape))

# Every layer of one sentence, as numpy: (layers, words, dim).
embedder = ElmoEmbedder(options_file, weight_file)
layers = embedder.embed_sentence(["Deep", "contextualized", "word", "representations"])
print("embed_sentence:", layers.shape)
