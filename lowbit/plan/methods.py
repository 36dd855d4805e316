"""The methods ``lowbit plan`` measures and predicts (the race's contenders), its defaults, and
the checks of its ``workers`` and ``methods`` arguments."""

from __future__ import annotations

from ..bench.race import POWERSGD_RANK  # noqa: F401 - the race's, which the plan assumes (torch's hook also
# starts compressing at its second iteration, as the race configures it)

#: the DDP anchor (``lowbit bench race``'s name)
BASELINE = "torch-ddp-fp32"


def _race_methods() -> dict:
    from ..bench.race import METHODS as RACE_METHODS

    return RACE_METHODS


#: DDP methods (torch DDP with or without a hook): name -> what it is; the race's contenders
DDP_METHODS = {m: r.description for m, r in _race_methods().items() if r.kind in ("torch", "hook")}
#: decentralized methods through lowbit's wrapper: name -> what it is
GOSSIP_METHODS = {m: r.description for m, r in _race_methods().items() if r.kind == "decentralized"}
#: every method, in the race's order (``lowbit bench race``'s :data:`~lowbit.bench.race.METHODS`)
METHODS = tuple(_race_methods())
DEFAULT_WORKERS = (8, 64, 512, 1024)
DEFAULT_BANDWIDTHS = ("1Gbit", "10Gbit", "25Gbit", "100Gbit")
#: assumed when none is given: a typical one-hop datacenter Ethernet latency (an assumption)
DEFAULT_LATENCY = "50us"
#: ranks of the ring the decentralized methods are measured on (two neighbours each)
GOSSIP_RING = 3


def _check_workers(workers) -> tuple[int, ...]:
    if isinstance(workers, str):
        try:
            workers = [int(w) for w in workers.split(",") if w.strip()]
        except ValueError:
            raise ValueError(f"workers must be comma-separated integers >= 2, got {workers!r}") from None
    workers = tuple(workers)
    if not workers or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in workers):
        raise ValueError(f"workers must be integers >= 2, got {workers!r}")
    return tuple(sorted(set(workers)))


def _check_methods(methods) -> tuple[str, ...]:
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    methods = tuple(methods)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods must name methods of {', '.join(METHODS)}; got {methods!r}")
    if BASELINE not in methods:
        methods = (BASELINE, *methods)
    return tuple(m for m in METHODS if m in methods)
