#!/usr/bin/env python
"""Make the bundled Tatoeba German-English sample (examples/tatoeba/data) from the full corpus.

Tatoeba (tatoeba.org, packaged by www.manythings.org/anki), CC BY 2.0. English sentences repeat
with alternative German translations, so the split is by unique English sentence: no test or
valid English sentence (nor any of its German versions) is seen in training. Test and valid keep
one pair per English sentence. Only pairs whose English side has MIN..MAX words are used, which
keeps the demo trainable on a CPU in minutes.

Usage: make_tatoeba_sample.py FULL_DIR OUT_DIR   (FULL_DIR holds full.de, full.en, _about.txt)
"""

import argparse
import collections
import gzip
import os
import random
import shutil


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("full_dir")
    p.add_argument("out_dir")
    p.add_argument("--train-pairs", type=int, default=60000)
    p.add_argument("--valid", type=int, default=1000, help="unique English sentences")
    p.add_argument("--test", type=int, default=1000, help="unique English sentences")
    p.add_argument("--min-words", type=int, default=3)
    p.add_argument("--max-words", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)

    with open(os.path.join(args.full_dir, "full.de"), encoding="utf-8") as f:
        de = [line.strip() for line in f]
    with open(os.path.join(args.full_dir, "full.en"), encoding="utf-8") as f:
        en = [line.strip() for line in f]
    if len(de) != len(en):
        raise SystemExit(f"error: full.de has {len(de)} lines but full.en has {len(en)}")

    by_english = collections.OrderedDict()
    for d, e in zip(de, en):
        if d and e and args.min_words <= len(e.split()) <= args.max_words:
            by_english.setdefault(e, []).append(d)
    english = list(by_english)
    rng = random.Random(args.seed)
    rng.shuffle(english)
    test_en = english[: args.test]
    valid_en = english[args.test: args.test + args.valid]
    train_pairs = [(d, e) for e in english[args.test + args.valid:] for d in by_english[e]]
    rng.shuffle(train_pairs)
    train_pairs = train_pairs[: args.train_pairs]

    os.makedirs(args.out_dir, exist_ok=True)
    splits = {
        "train": train_pairs,
        "valid": [(by_english[e][0], e) for e in valid_en],
        "test": [(by_english[e][0], e) for e in test_en],
    }
    for split, pairs in splits.items():
        for lang, side in (("de", 0), ("en", 1)):
            # mtime=0: the same input gives byte-identical files
            with gzip.GzipFile(os.path.join(args.out_dir, f"{split}.{lang}.gz"), "wb",
                               mtime=0) as f:
                f.write("".join(pair[side] + "\n" for pair in pairs).encode("utf-8"))
        print(f"{split}: {len(pairs)} pairs")
    shutil.copy(os.path.join(args.full_dir, "_about.txt"), os.path.join(args.out_dir, "_about.txt"))


if __name__ == "__main__":
    main()
