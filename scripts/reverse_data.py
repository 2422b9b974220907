#!/usr/bin/env python
"""Generate the reverse task: "learn to reverse a sequence" of random symbols.

Writes {train,valid,test}.{src,tgt} under OUT_DIR, one space-separated sequence per line; the
target is the source reversed. Symbols are drawn uniformly from a small alphabet, so the only way
to do well is to learn the task itself.
"""

import argparse
import os
import random

ALPHABET = [chr(c) for c in range(ord("a"), ord("z") + 1)]


def write_split(path_prefix: str, count: int, rng: random.Random, min_len: int, max_len: int,
                vocab: int) -> None:
    with open(path_prefix + ".src", "w") as src, open(path_prefix + ".tgt", "w") as tgt:
        for _ in range(count):
            seq = [rng.choice(ALPHABET[:vocab]) for _ in range(rng.randint(min_len, max_len))]
            src.write(" ".join(seq) + "\n")
            tgt.write(" ".join(reversed(seq)) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=20000, help="training pairs")
    p.add_argument("--valid", type=int, default=500)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--min-len", type=int, default=3)
    p.add_argument("--max-len", type=int, default=12)
    p.add_argument("--vocab", type=int, default=20, help=f"alphabet size (at most {len(ALPHABET)})")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if not 1 <= args.vocab <= len(ALPHABET):
        p.error(f"--vocab must be between 1 and {len(ALPHABET)}")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    os.makedirs(args.out_dir, exist_ok=True)
    rng = random.Random(args.seed)
    for split in ("train", "valid", "test"):
        write_split(os.path.join(args.out_dir, split), getattr(args, split), rng, args.min_len,
                    args.max_len, args.vocab)


if __name__ == "__main__":
    main()
