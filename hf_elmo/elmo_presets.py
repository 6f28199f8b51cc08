"""The published allenai ELMo configurations (bilm-tf options), by the name users know them by.

Plain data in a module of its own, so that `hf-elmo pretrain --help` can list them without importing transformers.
"""

ELMO_PRESETS = {
    "small": {"lstm_dim": 1024, "projection_dim": 128, "n_highway": 1},  # 2x1024_128_2048cnn_1xhighway
    "medium": {"lstm_dim": 2048, "projection_dim": 256, "n_highway": 1},  # 2x2048_256_2048cnn_1xhighway
    "original": {"lstm_dim": 4096, "projection_dim": 512, "n_highway": 2},  # 2x4096_512_2048cnn_2xhighway
}

# Not an allenai release: the 5.2M-parameter biLM this project pretrains on a 2-core CPU (about 45 minutes for the
# downstream NER experiment), the one the recipe comparison, the bilm-tf pretraining peer and that experiment share.
CPU_PRETRAINING_CONFIG = {
    "char_filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256]], "n_highway": 1, "char_embedding_dim": 16,
    "lstm_dim": 512, "projection_dim": 128, "num_lstm_layers": 2, "cell_clip": 3, "proj_clip": 3,
}
