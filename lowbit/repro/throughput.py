"""Paper 004's throughput study (section 5.6), analytic: the performance model
of Wen et al. 2017 (TernGrad) for 32 nodes x 4 V100 GPUs at 1 and 10 Gbps.

One iteration is the profiled compute of one GPU's minibatch followed by the
gradient exchange (no overlap), as in Wen et al.'s model, the exchange being
hierarchical: GPUs inside a node over NVLink, then the nodes over Ethernet.
Paper 004's quantizers are all-reduce compatible, so both levels are ring
all-reduces of the message: t_ring(n, S) = 2 (n - 1) alpha + 2 (n - 1)/n * 8 S / B
(lowbit's NetworkModel). S is ceil(d b / 8) bytes of codes plus the 4-byte
fp32 norm for b-bit QSGDMaxNorm, 4 d bytes for fp32. Throughput is
nodes * gpus * batch / (t_compute + t_intra + t_inter) images per second.
Encoding time is not modelled (it is not part of Wen et al.'s model).

Assumed inputs (not measured here; paper 004 profiled a p3.8xlarge but does
not publish its times): the compute time of one V100 for a CIFAR-10 minibatch
of 128 (paper 004's batch per worker), forward and backward in fp32, set to
the order of published V100 CIFAR-10 training rates (ResNet-50 about 1150
images/s, VGG-16 about 3650 images/s); NVLink 2.0 ring bandwidth 25 GB/s
(one link, one direction) with 10 us per hop; Ethernet 50 us per hop.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .common import write_outputs

NODES = 32
GPUS_PER_NODE = 4
BATCH_PER_GPU = 128
BITS = (2, 4, 8)
BANDWIDTHS_GBPS = (1, 10)
NVLINK_BANDWIDTH = 25e9 * 8  # bit/s
NVLINK_LATENCY = 10e-6  # s per hop
ETHERNET_LATENCY = 50e-6  # s per hop
NORM_BYTES = 4  # the fp32 max-norm sent with the codes


@dataclass(frozen=True)
class Model:
    name: str
    parameters: int  # as paper 004 states
    compute_seconds: float  # one V100, minibatch of BATCH_PER_GPU, forward + backward (assumed)


MODELS = (Model("ResNet-50", 23_520_842, 0.111), Model("VGG-16", 14_728_266, 0.035))


def ring_seconds(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` members (bandwidth in bit/s)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes * 8.0 / bandwidth


def message_bytes(parameters: int, bits: int | None) -> int:
    """Bytes one member contributes: b-bit codes and the norm, or fp32 (``bits=None``)."""
    if bits is None:
        return 4 * parameters
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16 (None for fp32), got {bits}")
    return math.ceil(parameters * bits / 8) + NORM_BYTES


def iteration(model: Model, bits: int | None, ethernet_gbps: float, nodes: int = NODES,
              gpus: int = GPUS_PER_NODE) -> dict:
    """Seconds of one iteration, split into its parts, and images per second."""
    if ethernet_gbps <= 0:
        raise ValueError(f"ethernet_gbps must be > 0, got {ethernet_gbps}")
    if nodes < 1 or gpus < 1:
        raise ValueError(f"nodes and gpus must be >= 1, got {nodes} and {gpus}")
    s = message_bytes(model.parameters, bits)
    intra = ring_seconds(gpus, s, NVLINK_BANDWIDTH, NVLINK_LATENCY)
    inter = ring_seconds(nodes, s, ethernet_gbps * 1e9, ETHERNET_LATENCY)
    total = model.compute_seconds + intra + inter
    return {"model": model.name, "bits": bits, "ethernet_gbps": ethernet_gbps, "message_bytes": s,
                "compute_seconds": model.compute_seconds, "intra_seconds": intra, "inter_seconds": inter,
                "iteration_seconds": total, "images_per_second": nodes * gpus * BATCH_PER_GPU / total}


def run(out: Path, quick: bool = False) -> dict:
    """Run this experiment (``quick``: the small digits version CI runs), write
    ``results.json``, ``table.md`` and its plots into ``out``, and return the results."""
    # Analytic: --quick computes the same (it is instant either way).
    rows = []
    for model in MODELS:
        for gbps in BANDWIDTHS_GBPS:
            base = iteration(model, None, gbps)
            for bits in (*BITS, None):
                r = iteration(model, bits, gbps)
                r["speedup_vs_fp32"] = r["images_per_second"] / base["images_per_second"]
                rows.append(r)
    inputs = {"nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "batch_per_gpu": BATCH_PER_GPU,
                  "models": [asdict(m) for m in MODELS], "nvlink_bandwidth_bit_s": NVLINK_BANDWIDTH,
                  "nvlink_latency_s": NVLINK_LATENCY, "ethernet_latency_s": ETHERNET_LATENCY, "norm_bytes": NORM_BYTES}
    results = {"experiment": "throughput-model", "quick": quick, "inputs": inputs, "rows": rows}
    table = [[r["model"], r["ethernet_gbps"], "fp32" if r["bits"] is None else r["bits"], r["message_bytes"],
              r["compute_seconds"], r["intra_seconds"], r["inter_seconds"], round(r["images_per_second"]),
              r["speedup_vs_fp32"]] for r in rows]
    inputs_table = [["nodes x GPUs per node", f"{NODES} x {GPUS_PER_NODE}", "paper 004, section 5.6"],
                    ["minibatch per GPU", BATCH_PER_GPU, "paper 004, section 5 (128 per worker)"],
                    *[[f"{m.name} parameters", m.parameters, "paper 004"] for m in MODELS],
                    *[[f"{m.name} compute per iteration (s)", m.compute_seconds,
                       "assumed: one V100, fp32, CIFAR-10, order of published rates"] for m in MODELS],
                    ["NVLink ring bandwidth (GB/s), latency (us)",
                     f"{NVLINK_BANDWIDTH / 8e9:g}, {NVLINK_LATENCY * 1e6:g}", "assumed: NVLink 2.0, one link"],
                    ["Ethernet bandwidth (Gbps), latency (us)",
                     f"{' and '.join(map(str, BANDWIDTHS_GBPS))}; {ETHERNET_LATENCY * 1e6:g}",
                     "paper 004 (bandwidths); latency assumed"]]
    write_outputs(
        out, results, "Throughput model (paper 004 section 5.6, Wen et al. 2017's model)",
        [(["input", "value", "source"], inputs_table),
         (["model", "Ethernet Gbps", "bits", "message bytes", "compute s", "intra-node s", "inter-node s",
           "images/s", "speedup vs fp32"], table)],
        notes="Iteration = compute + ring all-reduce inside the node (NVLink) + ring all-reduce across the "
              "nodes (Ethernet), no overlap; b-bit rows send ceil(d b / 8) bytes plus a 4-byte norm, fp32 "
              "sends 4 d bytes. Encoding time is not modelled. Analytic: no training.")
    from ..plot import plot_series

    for model in MODELS:
        mine = [r for r in rows if r["model"] == model.name]
        series = [(f"{g} Gbps", list(BITS), [r["images_per_second"] for r in mine
                                              if r["ethernet_gbps"] == g and r["bits"] is not None])
                  for g in BANDWIDTHS_GBPS]
        hlines = [(f"fp32, {g} Gbps", next(r["images_per_second"] for r in mine
                                           if r["ethernet_gbps"] == g and r["bits"] is None))
                  for g in BANDWIDTHS_GBPS]
        slug = model.name.lower().replace("-", "")
        plot_series(series, "bits per element", "images per second", out / f"throughput_{slug}.png",
                    logy=True, hlines=hlines)
    return results
