"""lowbit: train PyTorch models on many workers while sending few bits."""

__version__ = "0.1.0"
