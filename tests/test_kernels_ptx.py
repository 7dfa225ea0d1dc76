"""Every @triton.jit kernel in kernels.py compiled for real GPU targets, on any machine: Triton's
own compiler (ASTSource -> TTIR -> LLVM -> PTX) and the ptxas inside the triton wheel, no GPU
needed. The test fails on any compile error and on any register spill, naming kernel, arch, dtype
and BLOCK; its failure message (and `python tests/test_kernels_ptx.py`) prints registers per thread
for every compile.

How the kernels are found and launched (nothing is listed by hand but the public calls):
  * a subprocess imports kernels.py with TRITON_INTERPRET unset (conftest.py sets it on CPU, and
    then triton.jit makes interpreter objects), patches JITFunction.run to record each launch
    instead of running it, and calls every public kernel path (`exercise`, forward and backward,
    impl="triton") on CPU tensors: the launchers' own code picks the arguments, buffer dtypes,
    BLOCK and options (num_warps, ...), and the recorded arguments become the compile's signature,
    specialised as a CUDA launch would (pointers and ints divisible by 16, ints equal to 1 constant);
  * every JIT function in kernels.py must be launched, or called from a launched kernel: a new
    kernel that `exercise` does not reach fails the test, telling its author to launch it there.

Coverage (each compile is ~0.5 s of one core, so the default run compiles what proves something
distinct, and `python tests/test_kernels_ptx.py --full` every BLOCK in every dtype on both archs):
  * every kernel (and every constexpr variant the launchers make, e.g. rms_norm with and without a
    weight) at BLOCK 4096 (d = 4096) in fp32, bf16 and fp16 on sm_80 and sm_90: the most values
    per thread there are (8 per thread for the row kernels, 32 for the hyper-connection ones:
    _warps caps at 16, so below 4096 a thread holds at most half as many), i.e. the spill-prone
    compile, in each data dtype (fp32 statistics buffers stay fp32: the launchers allocate them) on
    each arch (Triton lowers and ptxas allocates registers per arch and dtype);
  * on sm_90 (the H100/H200 the project trains on) also BLOCK 64 (d = 64: fewer values than
    threads, a replicated layout) and 1024 (GPT-2's d = 768, masked) in bf16, the dtype a GPU
    trains in. The BLOCKs between (128 ... 2048) differ from these only in values per thread
    (at most 4 for the row kernels, 16 for the hyper-connection ones): --full compiles them.
The hyper-connection kernels are launched with n = 4 streams (a constexpr: variant N=4). A launch
that does not depend on d (sinkhorn's) is one compile per signature, which covers every BLOCK (the
table shows it under the first BLOCK that launched it).
Compiles run in parallel shards, one per core, at most 8. Each run compiles
afresh (an empty Triton cache, TRITON_ALWAYS_COMPILE), so that ptxas runs and reports
(TRITON_DUMP_PTXAS_LOG); CompiledKernel.n_regs / n_spills need a GPU (they come from loading the
cubin), so the numbers come from ptxas's -v log, in triton 3.6 and 3.9 alike.
"""
import argparse
import ast
import contextlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHS = (80, 90)
DTYPES = ("float32", "bfloat16", "float16")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
WIDTH = {64: 64, 128: 128, 256: 256, 512: 512, 1024: 768, 2048: 2048, 4096: 4096}  # BLOCK -> the d launched
LARGEST = 4096  # every dtype on every arch
SM90_BF16_BLOCKS = (64, 1024)  # and these in bf16 on sm_90


def planned(arch, dtype, block, full=False):
    """Whether the default run (or --full) compiles the kernels for this arch, dtype and BLOCK."""
    return full or block == LARGEST or (arch == 90 and dtype == "bfloat16" and block in SM90_BF16_BLOCKS)


# -----------------------------------------------------------------------------
# capture (runs in the subprocess, TRITON_INTERPRET unset)

def exercise(kernels, torch, dtype, d):
    """Every public kernel path once, forward and backward, on CPU tensors of `dtype`, width d,
    through the GPU path (kernels.triton_on_cpu(): the custom ops' CUDA implementations, which launch
    the kernels). A new public kernel path needs a call here (the coverage check names any kernel
    that no call reaches)."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    rows = (2, 8)  # 16 rows: a multiple of 16, as B * T is in training
    with kernels.triton_on_cpu():
        x = leaf(*rows, d)
        for weight in (leaf(d), None):
            backward(torch, kernels.rms_norm(x, weight, impl="triton"))
        backward(torch, kernels.nag_update(leaf(*rows, d), leaf(*rows, d), leaf(*rows, 1), impl="triton"))
        sources = [leaf(*rows, d) for _ in range(3)]  # the list the model passes
        backward(torch, kernels.depth_attention(sources, leaf(d), leaf(d), impl="triton"))
        # the dense mixes: dwa's shared weights [S], mudd's per token and way [..., 4, S]
        backward(torch, kernels.dense_mix(sources, leaf(3), impl="triton"))
        backward(torch, kernels.dense_mix(sources, leaf(*rows, 4, 3), impl="triton"))
        # hyper-connections with n = 4 streams, as the model calls them: mhc's pre-mix (proj in the
        # stream's dtype, fp32 scale and base), Sinkhorn on its fp32 logits and on logits in `dtype`,
        # the post-mix with mhc's per-row fp32 coefficients and with hc's shared ones
        n = 4
        fp32 = dict(dtype=torch.float32)
        streams = leaf(*rows, n, d)
        coef = [torch.randn(k, generator=gen, **fp32).requires_grad_() for k in (3, n * (n + 2))]
        u, h_post, res_logits = kernels.mhc_pre_mix(streams, leaf(*rows, n * (n + 2)), *coef, impl="triton")
        h_res = kernels.sinkhorn(res_logits, 20, impl="triton")
        backward(torch, kernels.hc_post_mix(streams, u, h_post, h_res, impl="triton"))
        backward(torch, kernels.sinkhorn(leaf(*rows, n, n), 20, impl="triton"))
        shared = [torch.randn(*shape, generator=gen, **fp32).requires_grad_() for shape in ((n,), (n, n))]
        backward(torch, kernels.hc_post_mix(leaf(*rows, n, d), leaf(*rows, d), *shared, impl="triton"))


def backward(torch, out):
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


TRITON_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
                "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1"}


def specialise(value, param):
    """(signature type, divisible by 16, constant) of one non-constexpr argument, as a CUDA launch
    specialises it in triton 3.6 ... 3.9."""
    align = not getattr(param, "do_not_specialize_on_alignment", False)
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        name = str(value.dtype).removeprefix("torch.")
        if name not in TRITON_DTYPE:
            raise TypeError(f"{param.name}: no triton pointer type for a {value.dtype} tensor")
        return "*" + TRITON_DTYPE[name], align and value.data_ptr() % 16 == 0, None
    if value is None:
        return "constexpr", False, None
    if isinstance(value, bool):
        return "u1", False, None
    if isinstance(value, int):
        if value == 1 and not getattr(param, "do_not_specialize", False):
            return "constexpr", False, 1
        kind = "i32" if -2**31 <= value < 2**31 else "i64" if -2**63 <= value < 2**63 else "u64"
        return kind, align and value % 16 == 0, None
    if isinstance(value, float):
        return "fp32", False, None
    raise TypeError(f"{param.name}: cannot derive a signature type from a {type(value).__name__}")


def record_launch(fn, args, kwargs):
    """A launch of JIT function fn, as (signature, constexprs, attrs, options) for triton.compile."""
    names = [p.name for p in fn.params]
    bound = dict(zip(names, args))
    options = {k: v for k, v in kwargs.items() if k not in names}
    bound.update((k, v) for k, v in kwargs.items() if k in names)
    for p in inspect.signature(fn.fn).parameters.values():
        if p.name not in bound and p.default is not inspect.Parameter.empty:
            bound[p.name] = p.default
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeError(f"{fn.__name__} launched without {missing}")
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = bound[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        kind, divisible, const = specialise(value, p)
        signature[p.name] = kind
        if kind == "constexpr":
            constexprs[p.name] = const
        elif divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return dict(signature=signature, constexprs=constexprs, attrs=attrs, options=options)


def jit_functions(module):
    """{JITFunction: name} for every JIT function in module, autotuned or heuristic ones unwrapped."""
    from triton.runtime.jit import JITFunction
    found = {}
    for name, obj in vars(module).items():
        for _ in range(4):
            if isinstance(obj, JITFunction):
                found.setdefault(obj, name)
                break
            obj = getattr(obj, "fn", None)
    return found


def capture(module, torch, dtype, d):
    """[(JITFunction, launch record)] for every launch that exercise() makes."""
    from triton.runtime.jit import JITFunction
    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, record_launch(self, args, kwargs)))

    patches = [(JITFunction, "run", run)]
    try:
        from triton.runtime.autotuner import Autotuner

        def autotuned(self, *args, **kwargs):  # every config, none benchmarked
            for config in self.configs:
                self.fn.run(*args, **kwargs, **config.all_kwargs())
        patches.append((Autotuner, "run", autotuned))
    except ImportError:
        pass
    saved = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in patches]
    try:
        for cls, attr, new in patches:
            setattr(cls, attr, new)
        exercise(module, torch, getattr(torch, dtype), d)
    finally:
        for cls, attr, old in saved:
            setattr(cls, attr, old)
    return launches


def reached(module, launched):
    """Names of the JIT functions that `launched` run: themselves and the helpers they call."""
    jit = jit_functions(module)
    by_name = {name: fn for fn, name in jit.items()}
    seen, todo = set(), [jit[fn] for fn in launched if fn in jit]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        src = getattr(by_name[name], "src", None) or by_name[name]._src
        todo += [n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name) and n.id in by_name]
    return seen


def plan(full=False):
    """(jobs, names of JIT functions that no launch reaches). A job is one compile:
    kernel, variant (its constexprs but BLOCK), arch, dtype, BLOCK and the ASTSource arguments."""
    import torch
    sys.path.insert(0, str(REPO))
    import kernels
    jobs, launched = {}, set()
    for block, d in WIDTH.items():
        for dtype in (dt for dt in DTYPES if any(planned(arch, dt, block, full) for arch in ARCHS)):
            for fn, rec in capture(kernels, torch, dtype, d):
                launched.add(fn)
                variant = ",".join(f"{k}={v}" for k, v in rec["constexprs"].items() if k != "BLOCK")
                for arch in (a for a in ARCHS if planned(a, dtype, block, full)):
                    job = dict(rec, kernel=fn.__name__, fn=fn, variant=variant, arch=arch, dtype=dtype,
                               block=block, covers=[])
                    key = json.dumps([fn.__name__, arch, rec["signature"], rec["constexprs"],
                                      sorted(map(str, rec["attrs"])), rec["options"]], default=str, sort_keys=True)
                    # a kernel whose launch does not depend on d or on the dtype (sinkhorn's on fp32
                    # logits) is one compile, which covers every (dtype, BLOCK) that launches it
                    jobs.setdefault(key, job)["covers"].append((dtype, block))
    uncovered = sorted(set(jit_functions(kernels).values()) - reached(kernels, launched))
    # biggest first, so that dealing them out round-robin balances the shards
    order = sorted(jobs.values(), key=lambda j: (-j["block"], j["kernel"], j["variant"], j["dtype"], j["arch"]))
    return order, uncovered


def compile_job(job):
    """Compile one job for its arch; registers and spills from the ptxas -v log Triton prints."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    out = {k: job[k] for k in ("kernel", "variant", "arch", "dtype", "block", "covers")}
    out["signature"] = ", ".join(f"{k}: {v}" for k, v in job["signature"].items())
    src = ASTSource(job["fn"], job["signature"], job["constexprs"], job["attrs"])
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # ptxas's report (and, on an error, Triton's dump)
            compiled = triton.compile(src, target=GPUTarget("cuda", job["arch"], 32), options=job["options"])
    except Exception as e:  # noqa: BLE001 -- any compile error is a finding
        lines = f"{type(e).__name__}: {e}".strip().splitlines()
        out["error"] = "\n".join(lines[:12] + (["..."] if len(lines) > 12 else []))
        return out
    out["seconds"] = round(time.perf_counter() - start, 2)
    out["num_warps"] = compiled.metadata.num_warps
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not (regs and spills):
        out["error"] = ("no ptxas -v report in Triton's output (TRITON_DUMP_PTXAS_LOG not honoured, or the "
                        "kernel came from a cache?):\n" + text[-2000:])
        return out
    out["regs"] = int(regs.group(1))
    out["stack"], out["spill_stores"], out["spill_loads"] = map(int, spills.groups())
    return out


def shard_main(index, count, full, path):
    jobs, uncovered = plan(full)
    results = [compile_job(job) for job in jobs[index::count]]
    Path(path).write_text(json.dumps(dict(results=results, uncovered=uncovered, jobs=len(jobs))))


# -----------------------------------------------------------------------------
# driver (the pytest process, or `python tests/test_kernels_ptx.py`)

def compile_all(workdir, full=False, shards=None):
    """Run the shards as subprocesses; returns (results, uncovered names, seconds)."""
    shards = shards or max(1, min(os.cpu_count() or 1, 8))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(Path(workdir) / "triton-cache"), TRITON_ALWAYS_COMPILE="1", TRITON_DUMP_PTXAS_LOG="1",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    start = time.perf_counter()
    procs = []
    for i in range(shards):
        path = Path(workdir) / f"shard{i}.json"
        cmd = [sys.executable, __file__, "--shard", f"{i}/{shards}", "--out", str(path)] + (["--full"] if full else [])
        procs.append((subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True), path))
    results, uncovered, errors, planned_jobs = [], set(), [], set()
    for proc, path in procs:
        try:
            output = proc.communicate(timeout=900)[0]
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            raise
        if proc.returncode != 0 or not path.exists():
            errors.append(f"shard {path.stem} exited with {proc.returncode}:\n{output[-4000:]}")
            continue
        data = json.loads(path.read_text())
        results += data["results"]
        uncovered.update(data["uncovered"])
        planned_jobs.add(data["jobs"])
    if errors:
        raise RuntimeError("\n\n".join(errors))
    if planned_jobs != {len(results)}:  # every shard planned the same jobs, and together they ran them all
        raise RuntimeError(f"the shards planned {sorted(planned_jobs)} compiles and ran {len(results)}")
    return results, sorted(uncovered), time.perf_counter() - start


def problems(results, uncovered):
    found = [f"{name}: a JIT function in kernels.py that is neither launched by exercise() in "
             f"tests/test_kernels_ptx.py nor called from a kernel it launches; add the public call that "
             f"launches it (forward and backward) to exercise()" for name in uncovered]
    for r in sorted(results, key=lambda r: (r["kernel"], r["variant"], r["arch"], r["dtype"], r["block"])):
        where = (f"{r['kernel']}{'[' + r['variant'] + ']' if r['variant'] else ''} sm_{r['arch']} "
                 f"{SHORT[r['dtype']]} BLOCK={r['block']} (d={WIDTH[r['block']]})")
        if "error" in r:
            found.append(f"{where}: compile error\n    signature: {r['signature']}\n    "
                         + r["error"].replace("\n", "\n    "))
        elif r["spill_stores"] or r["spill_loads"]:
            found.append(f"{where}: spills {r['spill_stores']} B stored / {r['spill_loads']} B loaded "
                         f"({r['regs']} registers, num_warps={r['num_warps']}, {r['stack']} B stack frame)")
    return found


def table(results):
    """Registers per thread by kernel / arch / dtype (rows) and BLOCK (columns); '+S<n>' marks n bytes
    spilled, 'ERR' a compile error, '.' a combination not compiled. num_warps: per BLOCK, if constant."""
    blocks = sorted({r["block"] for r in results})
    rows = {}
    for r in results:
        label = f"{r['kernel']}{'[' + r['variant'] + ']' if r['variant'] else ''}"
        cell = "ERR" if "error" in r else f"{r['regs']}" + (f"+S{r['spill_stores']}" if r["spill_stores"] or r["spill_loads"] else "")
        rows.setdefault((label, r["arch"], DTYPES.index(r["dtype"])), {})[r["block"]] = cell
    warps = {}
    for r in results:
        warps.setdefault(r["block"], set()).update([r["num_warps"]] if "num_warps" in r else [])
    head = ["kernel", "arch", "dtype"] + [str(b) for b in blocks]
    body = [[label, f"sm_{arch}", SHORT[DTYPES[dt]]] + [cells.get(b, ".") for b in blocks]
            for (label, arch, dt), cells in sorted(rows.items())]
    body.append(["num_warps", "", ""] + [",".join(map(str, sorted(warps[b]))) for b in blocks])
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]

    def fmt(row):
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in body])


def test_kernels_compile_for_sm80_sm90_without_spills(tmp_path):
    pytest.importorskip("triton")
    results, uncovered, seconds = compile_all(tmp_path)
    report = table(results)
    print(f"{len(results)} compiles in {seconds:.0f} s\n{report}")
    found = problems(results, uncovered)
    assert not found, "\n".join(found) + f"\n\nregisters per thread ({len(results)} compiles):\n{report}"
    # the coverage the docstring promises: every kernel variant in every dtype on both archs at BLOCK 4096,
    # and at BLOCK 64 and 1024 in bf16 on sm_90
    have = {(r["kernel"], r["variant"], r["arch"], dtype, block) for r in results for dtype, block in r["covers"]}
    for kernel, variant in {(k, v) for k, v, *_ in have}:
        for arch in ARCHS:
            for dtype in DTYPES:
                for block in WIDTH:
                    if planned(arch, dtype, block):
                        assert (kernel, variant, arch, dtype, block) in have, (kernel, variant, arch, dtype, block)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="every BLOCK in every dtype")
    parser.add_argument("--shards", type=int, default=None, help="parallel compiles (default: one per core, at most 8)")
    parser.add_argument("--shard", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shard:
        os.environ.pop("TRITON_INTERPRET", None)
        index, count = map(int, args.shard.split("/"))
        shard_main(index, count, args.full, args.out)
        sys.exit(0)
    with tempfile.TemporaryDirectory() as workdir:
        results, uncovered, seconds = compile_all(workdir, args.full, args.shards)
    print(f"{len(results)} compiles in {seconds:.0f} s; registers per thread ('+S<n>': n bytes spilled)\n")
    print(table(results))
    found = problems(results, uncovered)
    print("\n" + ("\n".join(found) if found else "no compile errors, no spills"))
    sys.exit(1 if found else 0)
