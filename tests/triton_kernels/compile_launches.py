"""Compile every kernel specialization recorded by ``record_launches.py`` for a CUDA GPU
(no GPU needed: Triton compiles to PTX and cubin on the CPU), and refuse approximate float32
division in the PTX (Triton's ``/`` is ``div.full.f32``; the kernels' bounds assume IEEE
division: ``kernels.gpu.div``).

    python compile_launches.py LAUNCHES.json [SM]      (SM: 90 by default, the H100/H200)

Integer arguments are typed by their recorded value (i32, or i64 beyond it), floats fp32,
as Triton's launcher types them."""

import importlib
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

DTYPES = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16", "bool": "i1",
          "uint8": "u8", "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint16": "u16",
          "uint32": "u32", "uint64": "u64"}
APPROXIMATE = ("div.full.f32", "div.approx.f32")


def specializations(launches: list[dict]) -> dict:
    """{(kernel, signature, constexprs): (JITFunction, signature, constexprs)}, deduplicated."""
    out = {}
    for rec in launches:
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        sig, const = {}, {}
        for p in fn.params:
            kind, v = rec["args"][p.name]
            if p.is_constexpr or kind in ("none", "other"):
                sig[p.name], const[p.name] = "constexpr", v
            elif kind == "tensor":
                sig[p.name] = "*" + DTYPES[v]
            else:
                sig[p.name] = {"bool": "i1", "float": "fp32"}.get(kind) or ("i32" if -2**31 <= v < 2**31 else "i64")
        key = (f"{rec['module']}.{rec['name']}", json.dumps(sig, sort_keys=True), json.dumps(const, sort_keys=True))
        out[key] = (fn, sig, const)
    return out


def main(path: str, sm: int = 90) -> int:
    todo = specializations(json.load(open(path)))
    target = GPUTarget("cuda", sm, 32)
    failures = []
    for key, (fn, sig, const) in sorted(todo.items(), key=lambda kv: kv[0]):
        try:
            ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target).asm["ptx"]
        except Exception as e:  # noqa: BLE001  (report every failing specialization)
            causes = []
            while e is not None:
                causes.append(f"{type(e).__name__}: {str(e)[-600:]}")
                e = e.__cause__ or e.__context__
            failures.append(f"{key[0]} {key[1]} {key[2]}\n  " + "\n  caused by ".join(causes))
            continue
        approx = [op for op in APPROXIMATE if op in ptx]
        if approx:
            failures.append(f"{key[0]} {key[1]}: approximate float32 division ({', '.join(approx)}); use gpu.div")
    print(f"{len(todo)} kernel specializations compiled for sm_{sm}, {len(failures)} failed")
    print("\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *(int(a) for a in sys.argv[2:])))
