"""Datasets read from their original file formats (no torchvision needed).

- :mod:`lowbit.data.idx`: MNIST-format IDX files (MNIST, Fashion-MNIST,
  KMNIST), plain or gzip-compressed.
- :mod:`lowbit.data.cifar`: the CIFAR-10 binary format (``data_batch_*.bin``,
  ``test_batch.bin``).
- :mod:`lowbit.data.download`: fetch a dataset into the cache with checksums.
"""

from .errors import DataError
from .cifar import load_cifar10, read_cifar_batch, write_cifar_batch
from .download import CACHE_DIR, DATASETS, download, find_dataset_dir
from .idx import load_mnist_like, read_idx, write_idx

__all__ = ["CACHE_DIR", "DATASETS", "DataError", "download", "find_dataset_dir", "load_cifar10", "load_mnist_like",
           "read_cifar_batch", "read_idx", "write_cifar_batch", "write_idx"]
