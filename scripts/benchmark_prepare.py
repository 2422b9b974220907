"""annotated-prepare's speed and memory at scale: lines per second of each stage with 1, 2, ...
workers, and the peak resident memory of a preparation of 1x and 16x the same corpus.

  python scripts/benchmark_prepare.py RAW_DIR [--copies 16] [--workers 1 2] [--work DIR]

RAW_DIR holds train/valid/test*.{de,en} (plain or .gz; e.g. Multi30k's or the bundled Tatoeba
sample, examples/tatoeba/data). Each preparation runs as a child process; its peak memory is
read from the kernel (the largest resident set of the process and, separately, of any one of its
children: the workers and fairseq-preprocess). Run it on an otherwise idle machine.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

STAGE = re.compile(r"^(tokenise \w+|apply BPE \S+|learn joint BPE[^:]*): ([\d,]+) (lines|pairs|merges) "
                   r"in ([\d.]+) s$")

CHILD = """
import json, resource, sys
from fairseq_plugin.cli import prepare
raw, dest, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
prepare.prepare(prepare.Preparation(raw, dest, "de", "en", bpe_merges=8000, workers=workers))
print("PEAKS " + json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                             resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))
"""


def copies_of(raw, copies, folder):
    """RAW's training text ``copies`` times over (valid and test once), in ``folder``."""
    import gzip

    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(raw):
        base, path = name[:-3] if name.endswith(".gz") else name, os.path.join(raw, name)
        match = re.fullmatch(r"(train|valid|test)\w*\.(\w+)", base)
        if not match:
            continue
        base = f"{match[1]}.{match[2]}"  # Multi30k's test2016.de is the test set
        with (gzip.open(path, "rb") if name.endswith(".gz") else open(path, "rb")) as f:
            data = f.read()
        with open(os.path.join(folder, base), "wb") as out:
            for _ in range(copies if base.startswith("train.") else 1):
                out.write(data)
    return folder


def prepare_once(raw, dest, workers):
    shutil.rmtree(dest, ignore_errors=True)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, raw, dest, str(workers)],
                          capture_output=True, text=True)
    seconds = time.monotonic() - started
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    stages = {}
    for line in proc.stderr.splitlines():
        match = STAGE.match(line.strip())
        if match:
            stages[match[1]] = (int(match[2].replace(",", "")), float(match[4]))
    peaks = json.loads(proc.stdout.split("PEAKS ")[1])
    return seconds, stages, [kib / 1024 for kib in peaks]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw_dir")
    p.add_argument("--copies", type=int, default=16)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--work", default="work/benchmark-prepare")
    args = p.parse_args(argv)

    once = copies_of(args.raw_dir, 1, os.path.join(args.work, "raw-x1"))
    many = copies_of(args.raw_dir, args.copies, os.path.join(args.work, f"raw-x{args.copies}"))
    with open(os.path.join(once, "train.de"), encoding="utf-8") as f:
        pairs = sum(1 for _ in f)
    print(f"corpus: {pairs:,} training pairs; {os.cpu_count()} cores here")

    print("\n| workers | stage | lines (pairs) | per second | per second a worker |")
    print("|---|---|---|---|---|")
    for workers in args.workers:
        seconds, stages, _ = prepare_once(once, os.path.join(args.work, f"bin-w{workers}"),
                                          workers)
        for stage, (n, s) in stages.items():
            if stage.startswith(("tokenise train", "apply BPE train")):
                print(f"| {workers} | {stage} | {n:,} | {n / s:,.0f} | {n / s / workers:,.0f} |")
        print(f"| {workers} | whole preparation | {pairs:,} pairs | {pairs / seconds:,.0f} | "
              f"({seconds:.1f} s) |")

    print("\n| corpus | pairs | time | peak RSS, main process | peak RSS, largest child |")
    print("|---|---|---|---|---|")
    workers = max(args.workers)
    for label, raw, n in (("1x", once, pairs), (f"{args.copies}x", many, pairs * args.copies)):
        seconds, _, (main_mib, child_mib) = prepare_once(
            raw, os.path.join(args.work, f"bin-{label}"), workers)
        print(f"| {label} | {n:,} | {seconds:.0f} s | {main_mib:.0f} MiB | {child_mib:.0f} MiB |")
    print(f"\n(peaks with {workers} workers; the largest child is a worker or fairseq-preprocess)")


if __name__ == "__main__":
    main()
