"""lowbit: train PyTorch models on many workers while sending few bits.

Large decode outputs on the CPU are advised as huge pages by lowbit itself
(:func:`lowbit.codecs.kernels.empty_output`); importing lowbit no longer sets PyTorch's
process-wide ``THP_MEM_ALLOC_ENABLE``, which earlier versions did.
"""

__version__ = "0.1.0"
