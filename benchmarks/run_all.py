"""Run every benchmark, write benchmarks/results/*.json and print the tables.

  python benchmarks/run_all.py            # kernel (64M float32, 1 and 2 threads), end-to-end
                                          # overhead, every=10 split step by step (CPU)
  python benchmarks/run_all.py --sweep    # also the kernel size x dtype x threads sweep
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def run(script, *args):
    cmd = [sys.executable, os.path.join(HERE, script), *args]
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    dev = ["--device", args.device]
    sfx = "" if args.device == "cpu" else f"_{args.device}"
    out = lambda name: os.path.join(RESULTS, f"{name}{sfx}.json")  # noqa: E731
    run("bench_kernel.py", *dev, "--json", out("kernel"))
    if args.sweep:
        run("bench_kernel.py", *dev, "--sweep", "--json", out("kernel_sweep"))
    run("bench_overhead.py", *dev, "--json", out("overhead"))
    if args.device == "cpu":  # host clocks: the step-level every=10 split is CPU-only
        for w in ("cnn", "gpt2"):
            run("bench_every.py", "--workload", w, "--json", out(f"every_{w}"))
        run("bench_read.py", "--json", out("read"))


if __name__ == "__main__":
    main()
