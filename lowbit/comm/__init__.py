"""comm: moving bytes between ranks, counting them, and the network model."""

from .base import Transport
from .distributed import TorchDistributedTransport, init_from_env
from .inprocess import ThreadTransport, ThreadWorld, run_threads
from .launcher import is_torchrun, launch
from .ledger import CommRecord, Ledger
from .netmodel import NetworkModel, parse_bandwidth, parse_latency

__all__ = [
    "CommRecord",
    "Ledger",
    "NetworkModel",
    "ThreadTransport",
    "ThreadWorld",
    "TorchDistributedTransport",
    "Transport",
    "init_from_env",
    "is_torchrun",
    "launch",
    "parse_bandwidth",
    "parse_latency",
    "run_threads",
]
