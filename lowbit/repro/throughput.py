"""Paper 004's throughput study (section 5.6): the performance model of Wen et al. 2017
(TernGrad) for 32 nodes x 4 GPUs at 1 and 10 Gbps, its compute and encoding times measured by
``lowbit plan`` on this device.

One iteration is one worker's compute (forward, backward and optimizer step of its minibatch),
then the encoding of its gradient, then the gradient exchange (no overlap), as in Wen et al.'s
model, the exchange being hierarchical: GPUs inside a node over NVLink, then the nodes over
Ethernet. Paper 004's quantizers are all-reduce compatible, so both levels are ring all-reduces
of the message: t_ring(n, S) = 2 (n - 1) alpha + 2 (n - 1)/n * 8 S / B (lowbit's NetworkModel).
Throughput is nodes * gpus * batch / (t_compute + t_encode + t_intra + t_inter) images per
second.

The preset (:data:`PRESET`) is paper 004's setup: 32 nodes x 4 GPUs, a CIFAR-10 minibatch of
128 per worker, ResNet-50 (23,520,842 parameters) and VGG-16 (14,728,266), 2, 4 and 8 bits
against fp32, Ethernet at 1 and 10 Gbps.

Measured here (:func:`measure_models`, :func:`lowbit.plan.measure`): the compute of one step of
:mod:`lowbit.plan_models`' ``resnet50`` and ``vgg16`` (the paper's parameter counts) in torch
DDP on this device, and the encoding: lowbit's ``qsgd_maxnorm`` DDP hook at b bits (the
max-norm quantizer of paper 004) on that model's DDP buckets, its torch ``allreduce_hook``
for fp32. Two message sizes are modelled: the paper's nominal one, S = ceil(d b / 8) bytes of
codes plus the 4-byte fp32 norm (fp32: 4 d), and what lowbit's hook really sends for the 128
workers whose codes one sum adds (``wire_bytes``, read from the hook on 128 mirrored ranks:
its norm rounds and packed integer codes, all buckets).

Assumptions (labelled in the table): NVLink 2.0 ring bandwidth 25 GB/s (one link, one
direction) with 10 us per hop; Ethernet 50 us per hop; where the device cannot run the paper's
batch of 128 in reasonable time (the CPU), a smaller batch is measured and the compute scaled
linearly to 128 (``compute_batch`` in the results says which); this device stands in for the
paper's V100s (the paper does not publish its profiled times).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .common import write_outputs

#: paper 004's setup
PRESET = {"nodes": 32, "gpus_per_node": 4, "batch_per_gpu": 128, "bits": (2, 4, 8), "bandwidths_gbps": (1, 10),
          "models": {"ResNet-50": ("resnet50", 23_520_842), "VGG-16": ("vgg16", 14_728_266)}}
NODES = PRESET["nodes"]
GPUS_PER_NODE = PRESET["gpus_per_node"]
BATCH_PER_GPU = PRESET["batch_per_gpu"]
BITS = PRESET["bits"]
BANDWIDTHS_GBPS = PRESET["bandwidths_gbps"]
NVLINK_BANDWIDTH = 25e9 * 8  # bit/s (assumed)
NVLINK_LATENCY = 10e-6  # s per hop (assumed)
ETHERNET_LATENCY = 50e-6  # s per hop (assumed)
NORM_BYTES = 4  # the fp32 max-norm sent with the codes


@dataclass(frozen=True)
class Model:
    """One model's inputs to the throughput model: ``compute_seconds`` of one worker's minibatch
    of :data:`BATCH_PER_GPU`, ``encode_seconds`` per bits (None: fp32) and ``wire_bytes`` per
    bits (what lowbit sends for the cluster's workers; None: use the nominal size)."""

    name: str
    parameters: int
    compute_seconds: float
    encode_seconds: dict = field(default_factory=dict)
    wire_bytes: dict = field(default_factory=dict)
    compute_batch: int = BATCH_PER_GPU
    device: str = ""


def ring_seconds(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` members (bandwidth in bit/s)."""
    from ..comm.ledger import CommRecord
    from ..comm.netmodel import NetworkModel

    return NetworkModel(bandwidth, latency).op_seconds(CommRecord("all_reduce", nbytes, 0, 0), n)


def message_bytes(parameters: int, bits: int | None) -> int:
    """Bytes one member contributes: b-bit codes and the norm, or fp32 (``bits=None``)."""
    if bits is None:
        return 4 * parameters
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16 (None for fp32), got {bits}")
    return math.ceil(parameters * bits / 8) + NORM_BYTES


def iteration(model: Model, bits: int | None, ethernet_gbps: float, nodes: int = NODES,
              gpus: int = GPUS_PER_NODE, wire: bool = False) -> dict:
    """Seconds of one iteration, split into its parts, and images per second; ``wire``: the
    message is what lowbit sends (``model.wire_bytes``), else the paper's nominal size."""
    if ethernet_gbps <= 0:
        raise ValueError(f"ethernet_gbps must be > 0, got {ethernet_gbps}")
    if nodes < 1 or gpus < 1:
        raise ValueError(f"nodes and gpus must be >= 1, got {nodes} and {gpus}")
    if wire and bits not in model.wire_bytes:
        raise ValueError(f"wire=True: model {model.name!r} has no wire size for bits={bits}")
    s = model.wire_bytes[bits] if wire else message_bytes(model.parameters, bits)
    intra = ring_seconds(gpus, s, NVLINK_BANDWIDTH, NVLINK_LATENCY)
    inter = ring_seconds(nodes, s, ethernet_gbps * 1e9, ETHERNET_LATENCY)
    encode = float(model.encode_seconds.get(bits, 0.0))
    total = model.compute_seconds + encode + intra + inter
    return {"model": model.name, "bits": bits, "ethernet_gbps": ethernet_gbps, "message_bytes": s, "wire": wire,
            "compute_seconds": model.compute_seconds, "encode_seconds": encode, "intra_seconds": intra,
            "inter_seconds": inter, "iteration_seconds": total,
            "images_per_second": nodes * gpus * BATCH_PER_GPU / total}


def measure_models(quick: bool = False, device: str = "auto") -> tuple[Model, ...]:
    """:data:`PRESET`'s models measured by ``lowbit plan`` on ``device`` (see the module doc):
    their compute per minibatch of :data:`BATCH_PER_GPU` (measured at that batch on CUDA; on
    the CPU at 8 images, 2 with ``quick``, scaled linearly), the ``qsgd_maxnorm`` hook's time at
    each of :data:`BITS` and ``allreduce_hook``'s (fp32) on the model's buckets, and the bytes
    the hook sends for ``nodes * gpus`` workers."""
    from ..bench.hooks import one_process_group
    from ..plan import _device, _hook_ops, _time_hooks, load_workload, measure

    dev = _device(device)
    batch = BATCH_PER_GPU if dev.type == "cuda" else (2 if quick else 8)
    n = NODES * GPUS_PER_NODE
    methods = ["torch-ddp-fp32", *(f"lowbit-qsgd-maxnorm-{b}" for b in BITS)]
    out = []
    for name, (task, params) in PRESET["models"].items():
        w = load_workload(task=task, batch_size=batch)
        p = measure(w, dev, workers=[n], methods=["torch-ddp-fp32"], repeats=1 if quick else 3,
                    warmup=0 if quick else 1)
        if p.parameters != params:
            raise RuntimeError(f"{task} has {p.parameters} parameters, paper 004 states {params}")
        with one_process_group(dev, "plan measures"):
            hooks = _time_hooks(p.buckets, methods, dev, 1 if quick else 3, warm=1)
        scale = BATCH_PER_GPU / batch
        compute = (p.forward_seconds + p.backward_seconds + p.optimizer_seconds) * scale
        encode = {None: sum(hooks["torch-ddp-fp32"]), **{b: sum(hooks[f"lowbit-qsgd-maxnorm-{b}"]) for b in BITS}}
        wire = {b: sum(r.nbytes for ops in _hook_ops(f"lowbit-qsgd-maxnorm-{b}", p.buckets, n, dev)
                       for _, r in ops) for b in BITS}
        wire[None] = 4 * params
        out.append(Model(name, params, compute, encode, wire, batch, p.device))
    return tuple(out)


def run(out: Path, quick: bool = False, models: tuple[Model, ...] | None = None) -> dict:
    """Run this experiment (``quick``: smaller measured batches, fewer repeats), write
    ``results.json``, ``table.md`` and its plots into ``out``, and return the results.
    ``models``: already measured inputs (default: :func:`measure_models` on this device)."""
    models = measure_models(quick) if models is None else models
    rows = _rows(models)
    inputs = {"nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "batch_per_gpu": BATCH_PER_GPU,
              "models": [{**asdict(m), "encode_seconds": {str(k): v for k, v in m.encode_seconds.items()},
                          "wire_bytes": {str(k): v for k, v in m.wire_bytes.items()}} for m in models],
              "nvlink_bandwidth_bit_s": NVLINK_BANDWIDTH,
              "nvlink_latency_s": NVLINK_LATENCY, "ethernet_latency_s": ETHERNET_LATENCY, "norm_bytes": NORM_BYTES}
    results = {"experiment": "throughput-model", "quick": quick, "inputs": inputs, "rows": rows}
    table = [[r["model"], r["ethernet_gbps"], "fp32" if r["bits"] is None else r["bits"],
              "lowbit wire" if r["wire"] else "nominal", r["message_bytes"], r["compute_seconds"],
              r["encode_seconds"], r["intra_seconds"], r["inter_seconds"], round(r["images_per_second"]),
              r["speedup_vs_fp32"]] for r in rows]
    write_outputs(
        out, results, "Throughput model (paper 004 section 5.6, Wen et al. 2017's model)",
        [(["input", "value", "source"], _inputs_table(models)),
         (["model", "Ethernet Gbps", "bits", "message", "message bytes", "compute s", "encode s", "intra-node s",
           "inter-node s", "images/s", "speedup vs fp32"], table)],
        notes="Iteration = compute + encode/decode + ring all-reduce inside the node (NVLink) + ring all-reduce "
              "across the nodes (Ethernet), no overlap; nominal b-bit rows send ceil(d b / 8) bytes plus a 4-byte "
              "norm, fp32 sends 4 d bytes; 'lowbit wire' rows send what lowbit's qsgd_maxnorm hook sends for "
              f"{NODES * GPUS_PER_NODE} workers. Compute and encode measured by lowbit plan on this device "
              "(not the paper's V100s).")
    _plot(models, rows, out)
    return results


def _rows(models: tuple[Model, ...]) -> list[dict]:
    """One :func:`iteration` per model, bandwidth, message (nominal or lowbit's wire) and bits,
    with its speedup over fp32."""
    rows = []
    for model in models:
        for gbps in BANDWIDTHS_GBPS:
            for wire in (False, True):
                base = iteration(model, None, gbps, wire=wire)
                for bits in (*BITS, None):
                    r = iteration(model, bits, gbps, wire=wire)
                    r["speedup_vs_fp32"] = r["images_per_second"] / base["images_per_second"]
                    rows.append(r)
    return rows


def _inputs_table(models: tuple[Model, ...]) -> list[list]:
    """The table of the model's inputs, each with where it comes from."""
    return [["nodes x GPUs per node", f"{NODES} x {GPUS_PER_NODE}", "paper 004, section 5.6"],
            ["minibatch per GPU", BATCH_PER_GPU, "paper 004, section 5 (128 per worker)"],
            *[[f"{m.name} parameters", m.parameters, "paper 004; lowbit.plan_models counts the same"]
              for m in models],
            *[[f"{m.name} compute per iteration (s)", m.compute_seconds,
               f"measured by lowbit plan on {m.device} at batch {m.compute_batch}"
               + ("" if m.compute_batch == BATCH_PER_GPU else
                  f", scaled x{BATCH_PER_GPU // m.compute_batch} to {BATCH_PER_GPU} (assumed linear)")]
              for m in models],
            *[[f"{m.name} encode+decode per iteration (s), bits " + ", ".join(
                "fp32" if b is None else str(b) for b in m.encode_seconds),
               ", ".join(f"{v:.4g}" for v in m.encode_seconds.values()),
               f"measured: qsgd_maxnorm hook (fp32: allreduce_hook) on the DDP buckets, {m.device}"]
              for m in models],
            ["NVLink ring bandwidth (GB/s), latency (us)",
             f"{NVLINK_BANDWIDTH / 8e9:g}, {NVLINK_LATENCY * 1e6:g}", "assumed: NVLink 2.0, one link"],
            ["Ethernet bandwidth (Gbps), latency (us)",
             f"{' and '.join(map(str, BANDWIDTHS_GBPS))}; {ETHERNET_LATENCY * 1e6:g}",
             "paper 004 (bandwidths); latency assumed"]]


def _plot(models: tuple[Model, ...], rows: list[dict], out: Path) -> None:
    """throughput_MODEL.png: images per second against bits, per bandwidth and message; fp32 as lines."""
    from ..plot import plot_series

    for model in models:
        mine = [r for r in rows if r["model"] == model.name]
        series = [(f"{g} Gbps{', lowbit wire' if w else ''}", list(BITS),
                   [r["images_per_second"] for r in mine
                    if r["ethernet_gbps"] == g and r["wire"] == w and r["bits"] is not None])
                  for g in BANDWIDTHS_GBPS for w in (False, True)]
        hlines = [(f"fp32, {g} Gbps", next(r["images_per_second"] for r in mine
                                           if r["ethernet_gbps"] == g and r["bits"] is None and not r["wire"]))
                  for g in BANDWIDTHS_GBPS]
        slug = model.name.lower().replace("-", "")
        plot_series(series, "bits per element", "images per second", out / f"throughput_{slug}.png",
                    logy=True, hlines=hlines)
