"""Which persistent compiled-graph cache gives the fastest warm start on the emulated backend?

    .venv/bin/python benchmarks/graph_cache_mechanisms.py [--repeats 3] [--only GROUP ...]

Method. A stand-in decoder step (6 layers of RMSNorm + rotary causal attention + SwiGLU MLP,
hidden 256, vocab 4096, logits of the last token) is compiled like neuron-serve's StepGraphs:
torch.compile(fullgraph=True, dynamic=False, backend="inductor"), 4 static token buckets
(16, 32, 64, 128) = 4 graphs. Per group and repetition a FRESH "cold" process compiles and
runs all 4 graphs against an empty TORCHINDUCTOR_CACHE_DIR and leaves its artifacts; then
each warm variant runs in its own FRESH process with those artifacts. Timed span = compile
(or load) + run all 4 graphs, incl. saving/loading artifacts; python start-up, import torch,
model construction and inductor's one-off CPU-ISA probe (it compiles test programs, cached
in the cache dir) are excluded and reported separately. Children report cache counters,
dynamo/backend/codegen seconds and logits (warm bit-identical to cold, cold close to eager).

Groups (one cold process) -> warm variants (one process each):
  inductor    FX-graph + AOTAutograd caches. Warm: keep the cold cache dir (it also holds the
              built .so files), or "mega-cache": torch.compiler.save_cache_artifacts() bytes
              loaded with load_cache_artifacts() into an EMPTY dir
  aot         torch.compile(fn).aot_compile() per bucket + save_compiled_function(); warm:
              torch.compiler.load_compiled_function() (no dynamo), empty or kept dir
  precompile  TORCH_CACHING_PRECOMPILE=1, experimental DynamoCache (guards + bytecode +
              backend, written by save_cache_artifacts()): kept dir, or bytes -> empty dir
  aoti        torch.export + AOTInductor .pt2 per bucket, weights outside the package
              (load_constants); warm: aoti_load_package(), empty or kept dir
  none        all caches off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1): the reference cost
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

BUCKETS = (16, 32, 64, 128)
HIDDEN, HEADS, LAYERS, VOCAB, FFN = 256, 4, 6, 4096, 768
# group -> (child mode, extra env, {warm variant: (load the saved bytes?, reuse the cold dir?)})
GROUPS = {
    "none": ("jit", {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}, {}),
    "inductor": ("jit", {}, {"fxgraph cache dir (kept)": (False, True),
                             "mega-cache bytes -> empty dir": (True, False)}),
    "aot": ("aot", {}, {"aot_compile bytes -> empty dir": (True, False),
                        "aot_compile bytes + kept dir": (True, True)}),
    "precompile": ("jit", {"TORCH_CACHING_PRECOMPILE": "1"},
                   {"caching precompile, kept dir": (False, True),
                    "caching precompile, bytes -> empty dir": (True, False)}),
    "aoti": ("aoti", {}, {"AOTInductor .pt2 -> empty dir": (True, False),
                          "AOTInductor .pt2 + kept dir": (True, True)}),
}


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN, eps=1e-6), nn.RMSNorm(HIDDEN, eps=1e-6)
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up, self.down = nn.Linear(HIDDEN, 2 * FFN, bias=False), nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, HEADS, -1).unbind(1)
        q, k = (torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
                for a, b in (y.chunk(2, -1) for y in (q, k)))
        scores = torch.einsum("thd,shd->hts", q, k) / (HIDDEN // HEADS) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.o(torch.einsum("hts,shd->thd", attn, v).reshape(t, HIDDEN))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm, self.lm_head = nn.RMSNorm(HIDDEN, eps=1e-6), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, positions):
        freqs = positions[:, None].float() / 10000 ** (torch.arange(0, 32, device=positions.device) / 32)
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x[-1:]))


def step(model, input_ids, positions):
    return model(input_ids, positions)


# ----------------------------------------------------------------------------- child
def child(mode: str, phase: str, work: str, load_blob: str) -> dict:
    from torch._dynamo.utils import compilation_time_metrics, counters
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    torch.manual_seed(0)
    model = Decoder().eval()
    inputs = {n: (torch.randint(0, VOCAB, (n,)), torch.arange(n)) for n in BUCKETS}
    cold, blob = phase == "cold", os.path.join(work, "megacache.bin")
    t0 = time.perf_counter()
    pick_vec_isa()  # one-off probe, timed apart (see docstring)
    isa_s, t0 = time.perf_counter() - t0, time.perf_counter()
    with torch.no_grad():
        if mode == "aot":  # one AOTCompiledFunction per bucket; we dispatch by shape
            fns = {}
            for n, args in inputs.items():
                path = os.path.join(work, f"aot_{n}.bin")
                if cold:
                    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="inductor")
                    fns[n] = compiled.aot_compile(((model, *args), {}))
                    fns[n].save_compiled_function(path)
                else:
                    with open(path, "rb") as f:
                        fns[n] = torch.compiler.load_compiled_function(f, f_globals=globals())
            outs = {n: fns[n](model, *args) for n, args in inputs.items()}
        elif mode == "aoti":  # one .pt2 per bucket, weights stay outside the package
            outs = {}
            for n, args in inputs.items():
                path = os.path.join(work, f"aoti_{n}.pt2")
                if cold:
                    torch._inductor.aoti_compile_and_package(
                        torch.export.export(model, args), package_path=path,
                        inductor_configs={"aot_inductor.package_constants_in_so": False})
                runner = torch._inductor.aoti_load_package(path)
                runner.load_constants(model.state_dict(), check_full_update=True, user_managed=True)
                outs[n] = runner(*args)
        else:
            if load_blob == "1":
                with open(blob, "rb") as f:
                    torch.compiler.load_cache_artifacts(f.read())
            compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="inductor")
            outs = {n: compiled(model, *args) for n, args in inputs.items()}
            saved = torch.compiler.save_cache_artifacts() if cold else None
            if saved is not None:  # None when caches are disabled
                with open(blob, "wb") as f:
                    f.write(saved[0])
        seconds = time.perf_counter() - t0
        eager_ok = all(torch.allclose(outs[n], step(model, *a), atol=1e-4) for n, a in inputs.items())
    torch.save(outs, os.path.join(work, "out_cold.pt" if cold else f"out_{os.getpid()}.pt"))
    metric = lambda k: round(sum(compilation_time_metrics.get(k, [])), 3)  # noqa: E731
    flat = {f"{g}.{k}": v for g in ("inductor", "aot_autograd", "dynamo_cache")
            for k, v in counters[g].items() if v and "cache" in k}
    return {"seconds": seconds, "isa_s": isa_s, "eager_ok": eager_ok, "pid": os.getpid(),
            "counters": {**flat, "unique_graphs": counters["stats"]["unique_graphs"]},
            "dynamo_s": metric("_compile.compile_inner"),
            "backend_s": metric("OutputGraph.call_user_compiler"),
            "inductor_codegen_s": metric("fx_codegen_and_compile")}


# ---------------------------------------------------------------------------- parent
def du_mb(path: str, files_only: bool = False) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if not (files_only and (d != path or f.startswith("out_")))) / 2**20


def run_child(group: str, phase: str, work: str, cache_dir: str, load_blob: bool) -> dict:
    mode, env = GROUPS[group][0], dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, **GROUPS[group][1])
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, phase,
                           work, "1" if load_blob else "0"], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300], "wall": wall}
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "wall": wall}


def one_repetition(group: str) -> dict:
    """One cold process, then every warm variant of the group; {"cold": .., variant: ..}."""
    work = tempfile.mkdtemp(prefix=f"gcm_{group}_")
    try:
        cold_dir = os.path.join(work, "cache_cold")
        res = {"cold": run_child(group, "cold", work, cold_dir, False)}
        if "error" in res["cold"]:
            return res
        blob_mb, dir_mb = du_mb(work, files_only=True), du_mb(cold_dir)
        for i, (variant, (load_blob, reuse)) in enumerate(GROUPS[group][2].items()):
            warm_dir = cold_dir if reuse else os.path.join(work, f"cache_warm{i}")
            r = res[variant] = run_child(group, "warm", work, warm_dir, load_blob)
            r["mb"] = (blob_mb if load_blob else 0) + (dir_mb if reuse else 0)
            if "error" not in r:
                a, b = (torch.load(os.path.join(work, f)) for f in ("out_cold.pt", f"out_{r['pid']}.pt"))
                r["identical"] = all(torch.equal(a[n], b[n]) for n in BUCKETS)
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


def med(runs: list, key: str) -> str:
    vals = [r[key] for r in runs if "error" not in r]
    return f"{statistics.median(vals):.2f}" if vals else "FAILED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(GROUPS), default=list(GROUPS))
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, buckets {BUCKETS}, "
          f"{args.repeats} repetitions", flush=True)
    rows, notes = [], []  # (group, "cold" or warm variant, successful runs)
    for group in args.only:
        reps = [one_repetition(group) for _ in range(args.repeats)]
        for key in ["cold", *GROUPS[group][2]]:
            runs = [r[key] for r in reps if key in r]
            ok = [r for r in runs if "error" not in r]
            rows.append((group, key, ok))
            print(f"  {group} / {key}: " + json.dumps(runs[-1] if runs else None)[:400], flush=True)
            notes += [f"{group} / {key} FAILED: {r['error']}" for r in runs if "error" in r]
            notes += [f"{group} / {key}: logits differ from eager" for r in ok if not r["eager_ok"]]
            notes += [f"{key}: warm logits NOT bit-identical to cold" for r in ok
                      if key != "cold" and not r["identical"]]
    cold_of = {g: med(ok, "seconds") for g, k, ok in rows if k == "cold"}
    print("\n| mechanism | cold s median | warm s median | artifact MB | cache hits (warm) |")
    print("|---|---|---|---|---|")
    for group, key, ok in rows:
        if key != "cold" or group == "none":
            hits = ", ".join(f"{k}={v}" for k, v in ok[-1]["counters"].items()
                             if "hit" in k or k == "unique_graphs") if ok else "-"
            mb = f"{statistics.median(r['mb'] for r in ok):.2f}" if key != "cold" and ok else "-"
            print(f"| {group}: {key} | {cold_of[group]} | "
                  f"{med(ok, 'seconds') if key != 'cold' else '(= cold)'} | {mb} | {hits} |")
    print("\nBreakdown (medians, s). wall: whole process incl. python + import torch; isa: CPU"
          " probe; dynamo: _compile.compile_inner (trace + backend, or DynamoCache install);"
          " backend: call_user_compiler; codegen: inductor fx_codegen_and_compile")
    print("\n| group | run | wall | isa | timed span | dynamo | backend | codegen | counters (last rep) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for group, key, ok in rows:
        if ok:
            print(f"| {group} | {key} | " + " | ".join(med(ok, k) for k in (
                "wall", "isa_s", "seconds", "dynamo_s", "backend_s", "inductor_codegen_s")) +
                " | " + ", ".join(f"{k}={v}" for k, v in ok[-1]["counters"].items()) + " |")
    print("\nNotes:\n" + ("\n".join(f"- {n}" for n in notes) if notes else
                         "- all runs succeeded; warm logits bit-identical to cold; all match eager"))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(*sys.argv[2:])), flush=True)
    else:
        main()
