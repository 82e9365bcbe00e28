"""Peak memory of diagnose_generate vs the number of decode steps (per-step statistics only, no activations kept).

Each length runs in a fresh subprocess (ru_maxrss is a per-process high-water mark); a tiny 2-layer GPT-2
(hidden 32, 1024 positions), healthy in fp16, so every run is the untraced generation loop of N steps.
Usage: python bench/generation_memory.py  (writes bench/results/generation_memory.md)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, torch
from transformers import GPT2Config, GPT2LMHeadModel
import ampdoctor
n = int(sys.argv[1])
torch.manual_seed(0)
m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=1024)).eval()
ids = torch.randint(1, 64, (1, 4))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
r = ampdoctor.diagnose_generate(m, ids, precision="fp16", max_new_tokens=n)
print(json.dumps({"steps": n, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "before_kib": base, "seconds": time.perf_counter() - t, "ok": r.ok}))
"""


def main() -> None:
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    for n in (16, 128, 512, 1000):
        out = subprocess.run([sys.executable, "-c", CHILD, str(n)], capture_output=True, text=True, env=env,
                             check=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
    lines = ["# diagnose_generate: peak RSS vs decode steps", "",
             "Tiny GPT-2 (2 layers, hidden 32), fp16 target, one fresh process per row; measured on the shared "
             "2-core machine (timings noisy, memory is not).", "",
             "| decode steps | RSS before (MiB) | peak RSS (MiB) | growth during diagnosis (MiB) | seconds | ok |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['steps']} | {r['before_kib'] / 1024:.0f} | {r['peak_kib'] / 1024:.0f} | "
                     f"{(r['peak_kib'] - r['before_kib']) / 1024:.1f} | {r['seconds']:.1f} | {r['ok']} |")
    text = "\n".join(lines) + "\n"
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/generation_memory.md", "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
