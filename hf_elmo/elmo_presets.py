"""The published allenai ELMo configurations (bilm-tf options), by the name users know them by.

Plain data in a module of its own, so that `hf-elmo pretrain --help` can list them without importing transformers.
"""

ELMO_PRESETS = {
    "small": {"lstm_dim": 1024, "projection_dim": 128, "n_highway": 1},  # 2x1024_128_2048cnn_1xhighway
    "medium": {"lstm_dim": 2048, "projection_dim": 256, "n_highway": 1},  # 2x2048_256_2048cnn_1xhighway
    "original": {"lstm_dim": 4096, "projection_dim": 512, "n_highway": 2},  # 2x4096_512_2048cnn_2xhighway
}
