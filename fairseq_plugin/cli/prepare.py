"""Raw parallel text -> fairseq data-bin: fairseq's Moses tokenisation (sacremoses), joint BPE
(subword-nmt), fairseq-preprocess --joined-dictionary.

  # your own files: RAW/train.de RAW/train.en RAW/valid.* RAW/test.* (plain or .gz)
  annotated-prepare --source-lang de --target-lang en --raw-dir RAW --dest data-bin/xx
  # a named corpus, downloaded when online, or read from --raw-dir
  annotated-prepare --corpus multi30k --dest data-bin/multi30k [--raw-dir DIR]
  annotated-prepare --corpus iwslt14 --dest data-bin/iwslt14 [--raw-dir de-en/ or de-en.tgz]
  annotated-prepare --corpus tatoeba --dest data-bin/tatoeba      (bundled sample; run in the
                                                                repository's root)

DEST receives the binarised data and dictionaries (fairseq-preprocess), ``bpe.codes``,
``text/`` (tokenised + BPE text), ``raw/`` (the raw test/valid text, the references for
sacreBLEU) and ``prepare.json`` (the settings, for evaluation and translation).
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Dict, Optional

from ..errors import PrepareError, command
from ..outputs import MARKER, check_destination, earlier_preparation
from ..signals import Stopped
from . import streaming
from .common import fairseq_cli, run
from .corpora import CORPORA, raw_text

# what a preparation writes into DEST: ours, and fairseq-preprocess's dictionaries, binarised
# splits (train.de-en.de.bin, valid1.de-en.en.idx, ...; its workers' parts, train.de-en.de.pt1.bin,
# when it stopped before merging them) and log
PREPARATION_ENTRY = re.compile(
    r"\.annotated-prepare|prepare\.json|prepare\.log|bpe\.codes|text|raw|dictionary"
    r"|shard\d+"
    r"|preprocess\.log"
    r"|dict\.[^.]+\.txt"
    r"|(train|valid\d*|test\d*)\.[^.]+-[^.]+\.[^.]+(\.pt\d+)?\.(bin|idx)")


def remove_earlier_preparation(dest) -> None:
    """Delete what an earlier preparation wrote in DEST, and only that: other files stay.
    prepare.json (a finished preparation) goes first and the marker last, so that a deletion
    stopped half-way leaves a preparation that is neither taken as finished nor someone else's."""
    order = {"prepare.json": 0, MARKER: 2}
    for name in sorted(os.listdir(dest), key=lambda name: order.get(name, 1)):
        path = os.path.join(dest, name)
        if not PREPARATION_ENTRY.fullmatch(name):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def exists(path):
    return os.path.exists(path) or os.path.exists(path + ".gz")


def raw_paths(raw_dir, prefix, src, tgt):
    """RAW/prefix.src and RAW/prefix.tgt (or .gz); one line for a missing or ambiguous one."""
    paths = [os.path.join(raw_dir, f"{prefix}.{lang}") for lang in (src, tgt)]
    for path in paths:
        if not exists(path):
            raise PrepareError(f"missing file {path} (or {path}.gz): expected "
                               f"RAW_DIR/{prefix}.{{{src},{tgt}}}, one sentence per line (other "
                               f"prefixes: --train, --valid, --test)")
        if os.path.exists(path) and os.path.exists(path + ".gz"):
            raise PrepareError(f"both {path} and {path}.gz are there: which is the corpus? "
                               f"Move one away")
    return paths


def check_scan(paths, found: streaming.Scan) -> None:
    if not found.pairs:
        raise PrepareError(f"{paths[0]} and {paths[1]} are empty")
    if not found.kept:
        raise PrepareError(f"{paths[0]} / {paths[1]}: every pair has an empty side")


def read_parallel(raw_dir, prefix, src, tgt):
    """Both sides of RAW/prefix.{src,tgt} in memory (for small files; the preparation itself
    streams them)."""
    paths = raw_paths(raw_dir, prefix, src, tgt)
    check_scan(paths, streaming.scan(paths))
    return [list(streaming.normalised_lines(p)) for p in paths]


def preprocess_summary(line: str):
    """fairseq-preprocess's summary of a binarised file ("[de] .../train.de: 3000 sents, ..."),
    or None."""
    summary = re.search(r"\[[^]]+\] \S+: \d+ sents, .*", line)
    return f"fairseq-preprocess {summary[0]}" if summary else None


def usable_cores() -> int:
    """The cores this process may run on (a cpuset or taskset limits them), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


DEFAULT_SPLITS = {"train": "train", "valid": "valid", "test": "test"}


@dataclasses.dataclass
class Preparation:
    """What a preparation is asked for (annotated-prepare's flags). ``splits``: each split's
    file prefix in RAW_DIR; ``workers``: processes for every stage (None: the usable cores);
    ``shards``: the training text as DEST/shard0 ... (valid and test in shard0 and DEST), one
    dictionary, for fairseq-train DEST/shard0:DEST/shard1:... ; ``bpe_sample_lines``: BPE learnt
    from the first N training pairs; ``force``: replace an earlier preparation in DEST."""

    raw_dir: str
    dest: str
    source_lang: str
    target_lang: str
    splits: Dict[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_SPLITS))
    bpe_merges: int = 8000
    workers: Optional[int] = None
    force: bool = False
    shards: int = 1
    bpe_sample_lines: Optional[int] = None

    @property
    def langs(self):
        return self.source_lang, self.target_lang


def prepare(preparation: Preparation) -> dict:
    """Tokenise (fairseq's moses tokenizer), learn and apply joint BPE, and binarise with
    fairseq-preprocess into DEST, streaming the text in chunks over the workers (streaming.py);
    returns the settings written to DEST/prepare.json. Bad input is refused in one line before
    DEST is touched: the tokenised text waits beside DEST until BPE is learnt."""
    p = preparation
    if p.workers is None:
        p = dataclasses.replace(p, workers=usable_cores())
    replace = check(p)
    splits = scan_splits(p)
    with streaming.workers(p.workers) as workers, tokenised_aside(p.dest) as tokenised:
        codes = tokenise_and_learn_bpe(p, splits, tokenised, workers)
        start_dest(p, splits, replace, codes)
        for split in splits.values():
            for lang in p.langs:
                streaming.apply_bpe(codes, os.path.join(tokenised, f"{split.name}.{lang}"),
                                    os.path.join(p.dest, "text", f"{split.name}.{lang}"),
                                    split.pairs, workers, f"apply BPE {split.name}.{lang}")
    binarise(p.dest, p.langs, p.workers, p.shards, splits["train"].pairs)
    return write_settings(p, splits, codes)


# each number annotated-prepare is given, and what it needs to be
AT_LEAST_ONE = (("bpe_merges", "--bpe-merges", "give a number of merges of at least 1"),
                ("workers", "--workers", "give at least 1 process"),
                ("shards", "--shards", "give at least 1 shard"),
                ("bpe_sample_lines", "--bpe-sample-lines", "give at least 1 line"))


def check(p: Preparation) -> bool:
    """Refuse bad numbers, language codes and destinations in one line; whether an earlier
    preparation in DEST is to be replaced."""
    for field, flag, need in AT_LEAST_ONE:
        value = getattr(p, field)
        if value is not None and value < 1:
            raise PrepareError(f"{flag} {value}: {need}")
    check_languages(p.source_lang, p.target_lang)
    return check_destination(p.dest, p.raw_dir, p.force)


def scan_splits(p: Preparation) -> Dict[str, streaming.Split]:
    """Every split read once before anything is written: both sides there, aligned, not empty.
    The training text leaves out pairs with an empty side (said in a line)."""
    splits = {}
    for split, prefix in p.splits.items():
        paths = raw_paths(p.raw_dir, prefix, *p.langs)
        found = streaming.scan(paths)
        check_scan(paths, found)
        train = split == "train"
        splits[split] = streaming.Split(split, paths, found.kept if train else found.pairs, train,
                                        len(found.empty_lines) if train else 0)
        if train and found.empty_lines:
            dropped = found.empty_lines
            print(f"train: left out {len(dropped)} pairs with an empty side (lines "
                  f"{', '.join(map(str, dropped[:10]))}{', ...' if len(dropped) > 10 else ''})",
                  file=sys.stderr, flush=True)
    if p.shards > splits["train"].pairs:
        raise PrepareError(f"--shards {p.shards}: more shards than the {splits['train'].pairs} "
                           f"training pairs")
    return splits


@contextlib.contextmanager
def tokenised_aside(dest):
    """A temporary folder beside DEST for the tokenised text (DEST untouched until BPE is
    learnt)."""
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=os.path.basename(os.path.abspath(dest)) +
                                     ".tokenised-", dir=parent) as folder:
        yield folder


def tokenise_and_learn_bpe(p: Preparation, splits, tokenised, workers) -> str:
    """Each split tokenised into ``tokenised``; joint BPE codes learnt from the training text's
    word counts (of its first ``bpe_sample_lines`` pairs); one line when no merge was learnt."""
    for split in splits.values():
        count = (min(p.bpe_sample_lines or split.pairs, split.pairs)
                 if split.name == "train" else 0)
        counts = streaming.tokenise(split, [os.path.join(tokenised, f"{split.name}.{lang}")
                                            for lang in p.langs], p.langs, workers, count)
        if split.name == "train":
            codes = streaming.learn_bpe(counts, p.bpe_merges, f"learn joint BPE on train."
                                        f"{p.source_lang} + train.{p.target_lang}")
    learnt = merges_in(codes)
    if learnt < 1:
        raise PrepareError(f"no pair of symbols occurs twice in train.{p.source_lang} + "
                           f"train.{p.target_lang}, so BPE learnt no merge: give more text")
    if learnt < p.bpe_merges:
        print(f"BPE learnt {learnt} of the {p.bpe_merges} merges asked for: no other pair of "
              f"symbols occurs twice in the training text", file=sys.stderr, flush=True)
    return codes


def merges_in(codes: str) -> int:
    return codes.count("\n") - 1  # "#version: 0.2", then a merge per line


def start_dest(p: Preparation, splits, replace: bool, codes: str) -> None:
    """DEST, once the input is known to be good: an earlier preparation removed (--force), our
    marker, text/, raw/ with the raw valid and test text (the references for detokenised
    sacreBLEU), and bpe.codes."""
    if replace:
        remove_earlier_preparation(p.dest)
    os.makedirs(p.dest, exist_ok=True)
    open(os.path.join(p.dest, MARKER), "w").close()
    raw = os.path.join(p.dest, "raw")
    os.makedirs(os.path.join(p.dest, "text"))
    os.makedirs(raw)
    for split in ("valid", "test"):
        for lang, path in zip(p.langs, splits[split].paths):
            with open(os.path.join(raw, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in streaming.normalised_lines(path))
    with open(os.path.join(p.dest, "bpe.codes"), "w", encoding="utf-8") as f:
        f.write(codes)


def write_settings(p: Preparation, splits, codes: str) -> dict:
    """DEST/prepare.json (for evaluation and translation), whole or not at all."""
    settings = {"source_lang": p.source_lang, "target_lang": p.target_lang, "bpe": "subword_nmt",
                "bpe_codes": "bpe.codes", "bpe_merges": p.bpe_merges,
                "bpe_merges_learnt": merges_in(codes), "tokenizer": "moses",
                "splits": {name: split.pairs for name, split in splits.items()},
                "train_pairs_left_out_empty": splits["train"].left_out}
    if p.bpe_sample_lines:
        settings["bpe_sample_lines"] = p.bpe_sample_lines
    if p.shards > 1:
        settings["shards"] = p.shards
        settings["data"] = ":".join(os.path.join(p.dest, f"shard{i}") for i in range(p.shards))
    with open(os.path.join(p.dest, "prepare.json.part"), "w") as f:
        json.dump(settings, f, indent=2)
    os.replace(os.path.join(p.dest, "prepare.json.part"), os.path.join(p.dest, "prepare.json"))
    return settings


def binarise(dest, langs, workers, shards, train_pairs) -> None:
    """fairseq-preprocess --joined-dictionary of DEST/text into DEST; with shards, the
    dictionary of the whole training text first, then each shard's training text into
    DEST/shardI with it (valid and test in shard0, and in DEST for evaluation)."""
    text = os.path.join(dest, "text")
    common = ["--source-lang", langs[0], "--target-lang", langs[1], "--joined-dictionary",
              "--workers", str(workers)]
    held_out = ["--validpref", os.path.join(text, "valid"), "--testpref",
                os.path.join(text, "test")]
    runs = []
    if shards == 1:
        runs.append(["--trainpref", os.path.join(text, "train"), *held_out, "--destdir", dest])
    else:
        for lang in langs:
            streaming.split_into_shards(os.path.join(text, f"train.{lang}"), shards, train_pairs,
                                        os.path.join(text, f"train.shard{{}}.{lang}"))
        # (fairseq-preprocess writes no dictionary over one in its --destdir: made aside first)
        aside = os.path.join(dest, "dictionary")
        dictionary = ["--srcdict", os.path.join(aside, f"dict.{langs[0]}.txt")]
        runs.append(["--trainpref", os.path.join(text, "train"), "--dict-only", "--destdir",
                     aside])
        runs.append([*held_out, *dictionary, "--destdir", dest])
        for i in range(shards):
            runs.append(["--trainpref", os.path.join(text, f"train.shard{i}"),
                         *(held_out if i == 0 else []), *dictionary,
                         "--destdir", os.path.join(dest, f"shard{i}")])
    # (fairseq-preprocess keeps its own log, DEST/preprocess.log: ours is another file)
    with open(os.path.join(dest, "prepare.log"), "w"):
        pass
    for args in runs:
        run([fairseq_cli("fairseq-preprocess"), *common, *args],
            os.path.join(dest, "prepare.log"), show=preprocess_summary,
            echo=functools.partial(print, file=sys.stderr), append=True)
    if shards > 1:
        shutil.rmtree(os.path.join(dest, "dictionary"))


def check_languages(source_lang, target_lang) -> None:
    """Language codes fairseq can find again in its file names (train.de-en.de.bin): letters,
    digits and _, two different ones."""
    for option, code in (("--source-lang", source_lang), ("--target-lang", target_lang)):
        if not re.fullmatch(r"\w+", code):
            raise PrepareError(f"{option} {code}: use letters, digits and _ only (fairseq splits "
                               f"its file names at '.' and '-'), e.g. pt_br")
    if source_lang == target_lang:
        raise PrepareError(f"--source-lang and --target-lang are both {source_lang}; give two "
                           f"different codes")


@command("annotated-prepare")
def main(argv=None):
    parser = argument_parser()
    args = parser.parse_args(argv)
    corpus = CORPORA.get(args.corpus, {})
    src = args.source_lang or corpus.get("source_lang")
    tgt = args.target_lang or corpus.get("target_lang")
    if not (src and tgt):
        parser.error("give --source-lang and --target-lang, or a named --corpus")
    if not (args.raw_dir or corpus):
        parser.error("give --raw-dir (or a named --corpus)")
    splits = {split: getattr(args, split) or prefix
              for split, prefix in corpus.get("splits", DEFAULT_SPLITS).items()}
    dest = os.path.normpath(args.dest)  # DEST/ and DEST: DEST.raw, not DEST/.raw
    try:
        check_languages(src, tgt)
        # before anything is fetched, unpacked or converted
        check_destination(dest, args.raw_dir or corpus.get("bundled") or dest + ".raw",
                          args.force)
        raw_dir = raw_text(args.corpus, args.raw_dir, dest, src, tgt)
        settings = prepare(Preparation(raw_dir, dest, src, tgt, splits, args.bpe_merges,
                                       args.workers, args.force, args.shards,
                                       args.bpe_sample_lines))
    except (KeyboardInterrupt, Stopped) as stop:  # what the rerun should do (command)
        stop.note = (f"an unfinished preparation is left in {dest}: run the same command with "
                     f"--force to prepare it again" if earlier_preparation(dest)
                     else f"nothing was written to {dest}")
        raise
    print(f"prepared {dest}: " + ", ".join(f"{s} {n} pairs"
                                            for s, n in settings["splits"].items()))


def argument_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--corpus", choices=sorted(CORPORA), help="a named corpus")
    p.add_argument("--raw-dir", help="directory of raw files PREFIX.LANG (plain or .gz)")
    p.add_argument("--source-lang", "-s")
    p.add_argument("--target-lang", "-t")
    p.add_argument("--train", default=None, help="train prefix (default: train)")
    p.add_argument("--valid", default=None, help="valid prefix (default: valid)")
    p.add_argument("--test", default=None, help="test prefix (default: test)")
    p.add_argument("--dest", required=True, help="output data-bin directory")
    p.add_argument("--bpe-merges", type=int, default=8000, help="number of joint BPE merges")
    p.add_argument("--workers", type=int, default=None,
                   help="processes for every stage (default: the cores this may use)")
    p.add_argument("--shards", type=int, default=1,
                   help="the training text as K data-bins DEST/shard0 ... with one dictionary "
                        "(fairseq-train DEST/shard0:DEST/shard1:..., one shard an epoch)")
    p.add_argument("--bpe-sample-lines", type=int, default=None, metavar="N",
                   help="learn BPE from the first N training pairs (very large corpora)")
    p.add_argument("--force", action="store_true", help="replace an earlier preparation in --dest")
    return p


if __name__ == "__main__":
    main()
