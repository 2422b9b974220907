#!/usr/bin/env python
"""Make the bundled Tatoeba German-English sample (examples/tatoeba/data) from the full corpus.

Tatoeba (tatoeba.org, packaged by www.manythings.org/anki), CC BY 2.0. Sentences repeat on both
sides (one English sentence with several German translations and the other way round), so pairs
are grouped: two pairs are in one group when they share their German or their English side after
Moses punctuation normalisation and the preparation's tokenisation (``grouping_key``), and groups
are connected through shared sentences. Valid and test take one pair from each of their groups;
training takes pairs only from the other groups, so no valid or test sentence, on either side,
occurs in training. Only pairs whose English side has MIN..MAX words are used, which keeps the
demo trainable on a CPU in minutes.

Usage: make_tatoeba_sample.py FULL_DIR OUT_DIR   (FULL_DIR holds full.de, full.en, _about.txt)
"""

import argparse
import collections
import gzip
import os
import random
import shutil


def grouping_key(lang):
    """A sentence's key: Moses punctuation normalisation, then fairseq's Moses tokenisation (as
    annotated-prepare tokenises), so sentences differing only in quotes, dashes or spacing share
    one key."""
    from sacremoses import MosesPunctNormalizer

    from fairseq_plugin.cli.streaming import moses_tokenizer

    normalise, tokenise = MosesPunctNormalizer(lang=lang).normalize, moses_tokenizer(lang)
    return lambda sentence: tokenise(normalise(sentence))


def connected_groups(pairs):
    """Indices of ``pairs`` grouped so that pairs sharing a normalised German or English sentence
    (directly or through other pairs) are in one group; groups in order of first appearance."""
    normalise = {"de": grouping_key("de"), "en": grouping_key("en")}
    parent = list(range(len(pairs)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_with = {}  # (language, normalised sentence) -> the first pair that has it
    for i, (d, e) in enumerate(pairs):
        for key in (("de", normalise["de"](d)), ("en", normalise["en"](e))):
            j = first_with.setdefault(key, i)
            parent[root(i)] = root(j)
    groups = collections.OrderedDict()
    for i in range(len(pairs)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("full_dir")
    p.add_argument("out_dir")
    p.add_argument("--train-pairs", type=int, default=60000)
    p.add_argument("--valid", type=int, default=1000, help="pairs (one per group)")
    p.add_argument("--test", type=int, default=1000, help="pairs (one per group)")
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

    pairs = [(d, e) for d, e in zip(de, en)
             if d and e and args.min_words <= len(e.split()) <= args.max_words]
    groups = connected_groups(pairs)
    rng = random.Random(args.seed)
    rng.shuffle(groups)
    test = [pairs[group[0]] for group in groups[: args.test]]
    valid = [pairs[group[0]] for group in groups[args.test: args.test + args.valid]]
    train_pairs = [pairs[i] for group in groups[args.test + args.valid:] for i in group]
    rng.shuffle(train_pairs)
    train_pairs = train_pairs[: args.train_pairs]

    os.makedirs(args.out_dir, exist_ok=True)
    splits = {"train": train_pairs, "valid": valid, "test": test}
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
