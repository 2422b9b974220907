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
import functools
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import urllib.request

from ..errors import PrepareError, command
from ..outputs import MARKER, check_destination, earlier_preparation, own_folder
from ..signals import Stopped
from . import streaming
from .common import fairseq_cli, run

# name -> languages, split prefixes, download (url template by file) or bundled directory
CORPORA = {
    "multi30k": {
        "source_lang": "de", "target_lang": "en",
        "splits": {"train": "train", "valid": "valid", "test": "test2016"},
        "download": {
            # Multi30k task 1 raw files (Elliott et al. 2016); non-commercial research terms
            f"{split}.{lang}": "https://raw.githubusercontent.com/multi30k/dataset/master/data/"
                               f"task1/raw/{remote}.{lang}.gz"
            for split, remote in (("train", "train"), ("valid", "val"),
                                  ("test2016", "test_2016_flickr"))
            for lang in ("de", "en")
        },
    },
    "iwslt14": {
        # IWSLT'14 TED talks de-en, as fairseq's examples use it (their mirror of the WIT3 files):
        # train.tags.de-en.* minus every 23rd line (valid), test = dev2010 + dev2012 + tst2010-12
        "source_lang": "de", "target_lang": "en",
        "splits": {"train": "train", "valid": "valid", "test": "test"},
        "archive": "http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
    },
    "tatoeba": {
        "source_lang": "de", "target_lang": "en",
        "splits": {"train": "train", "valid": "valid", "test": "test"},
        "bundled": os.path.join("examples", "tatoeba", "data"),  # in this repository's root
    },
}




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


def fetch(url, directory):
    """Download url into directory (once); return the file's path."""
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, url.rsplit("/", 1)[-1])
    if not os.path.exists(target):
        print(f"downloading {url}", flush=True)
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                data = r.read()
        except OSError as e:
            raise PrepareError(f"cannot download {url} ({e}); on a machine without internet "
                               f"access, pass the raw files with --raw-dir")
        with open(target + ".part", "wb") as f:
            f.write(data)
        os.replace(target + ".part", target)
    return target


def download(corpus, raw_dir):
    """Fetch a named corpus's raw files into raw_dir (gunzipped)."""
    os.makedirs(raw_dir, exist_ok=True)
    for name, url in CORPORA[corpus]["download"].items():
        target = os.path.join(raw_dir, name)
        if not os.path.exists(target):
            downloaded = fetch(url, raw_dir + ".download")
            with open(downloaded, "rb") as f:
                data = f.read()
            try:
                data = gzip.decompress(data) if url.endswith(".gz") else data
            except (OSError, EOFError) as e:
                raise PrepareError(f"{downloaded} is not a whole gzip file ({e}); delete it to "
                                   f"download it again") from e
            with open(target + ".part", "wb") as f:
                f.write(data)
            os.replace(target + ".part", target)


IWSLT_TEST_SETS = ["IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
                   "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012"]
IWSLT_META_TAGS = ("<url", "<talkid", "<keywords", "<speaker", "<reviewer", "<translator",
                   "<doc", "</doc")


def _iwslt_train_lines(path):
    """train.tags.de-en.LANG: drop the talks' metadata lines, keep titles and descriptions."""
    out = []
    with open(path, encoding="utf-8", newline="\n") as f:
        for line in f:
            line = line.strip()
            if line.startswith(IWSLT_META_TAGS):
                continue
            out.append(re.sub(r"</?(title|description)>", "", line).strip())
    return out


def _iwslt_xml_segments(path):
    with open(path, encoding="utf-8") as f:
        return [m.group(1).strip() for m in re.finditer(r"<seg[^>]*>(.*?)</seg>", f.read())]




def iwslt14_to_raw(extracted, raw_dir, src="de", tgt="en", unpack_dir=None):
    """The extracted de-en/ folder (or the .tgz, unpacked into ``unpack_dir``, by default next
    to it) -> raw_dir/{train,valid,test}.{de,en}."""
    import tarfile

    if os.path.isfile(extracted):
        where = unpack_dir or os.path.dirname(os.path.abspath(extracted))
        with tarfile.open(extracted) as tar:
            if hasattr(tarfile, "data_filter"):  # refuse unsafe members where Python can
                tar.extractall(where, filter="data")
            else:
                tar.extractall(where)
        extracted = os.path.join(where, "de-en")
    pair = f"{src}-{tgt}"
    for lang in (src, tgt):
        names = [f"train.tags.{pair}.{lang}"] + [f"{test}.{pair}.{lang}.xml"
                                                  for test in IWSLT_TEST_SETS]
        for path in (os.path.join(extracted, name) for name in names):
            if not os.path.exists(path):
                raise PrepareError(f"missing {path}: --raw-dir for iwslt14 is the extracted "
                                   f"{pair}/ folder (or {pair}.tgz) of IWSLT'14")
    train = {lang: _iwslt_train_lines(os.path.join(extracted, f"train.tags.{pair}.{lang}"))
             for lang in (src, tgt)}
    if len(train[src]) != len(train[tgt]):
        raise PrepareError(f"IWSLT'14 train.tags files differ in length after cleaning "
                           f"({len(train[src])} vs {len(train[tgt])})")
    os.makedirs(raw_dir, exist_ok=True)
    for lang in (src, tgt):
        lines = train[lang]
        test = [seg for name in IWSLT_TEST_SETS
                for seg in _iwslt_xml_segments(os.path.join(extracted, f"{name}.{pair}.{lang}.xml"))]
        for split, part in (("train", [x for i, x in enumerate(lines, 1) if i % 23]),
                            ("valid", [x for i, x in enumerate(lines, 1) if i % 23 == 0]),
                            ("test", test)):
            with open(os.path.join(raw_dir, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.writelines(x + "\n" for x in part)
    return raw_dir


def moses_tokenizer(lang):
    """fairseq's own ``--tokenizer moses`` for ``lang`` (sacremoses with aggressive dash splits and
    XML escaping, no punctuation normalisation): fairseq-interactive and the hub tokenise new
    text exactly as the training data was."""
    from fairseq.data.encoders.moses_tokenizer import MosesTokenizer, MosesTokenizerConfig

    return MosesTokenizer(MosesTokenizerConfig(source_lang=lang, target_lang=lang)).encode


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


def prepare(raw_dir, dest, source_lang, target_lang, splits, bpe_merges=8000, workers=None,
            force=False, shards=1, bpe_sample_lines=None):
    """Tokenise (fairseq's moses tokenizer), learn and apply joint BPE, and binarise with
    fairseq-preprocess into DEST, streaming the text in chunks over ``workers`` processes
    (streaming.py; default: the usable cores); returns the settings written to
    DEST/prepare.json. Bad input is refused in one line before DEST is touched. ``shards``:
    the training text binarised as DEST/shard0 ... (valid and test in shard0 and DEST), one
    dictionary, for fairseq-train DEST/shard0:DEST/shard1:... . ``bpe_sample_lines``: BPE learnt
    from the first N training pairs."""
    workers = usable_cores() if workers is None else workers
    if bpe_merges < 1:
        raise PrepareError(f"--bpe-merges {bpe_merges}: give a number of merges of at least 1")
    if workers < 1:
        raise PrepareError(f"--workers {workers}: give at least 1 process")
    if shards < 1:
        raise PrepareError(f"--shards {shards}: give at least 1 shard")
    if bpe_sample_lines is not None and bpe_sample_lines < 1:
        raise PrepareError(f"--bpe-sample-lines {bpe_sample_lines}: give at least 1 line")
    check_languages(source_lang, target_lang)
    replace = check_destination(dest, raw_dir, force)
    langs = (source_lang, target_lang)
    paths = {split: raw_paths(raw_dir, prefix, *langs) for split, prefix in splits.items()}
    scans = {}
    for split, pair in paths.items():  # every split read once before anything is written
        scans[split] = streaming.scan(pair)
        check_scan(pair, scans[split])
    dropped = scans["train"].empty_lines
    if dropped:
        print(f"train: left out {len(dropped)} pairs with an empty side (lines "
              f"{', '.join(map(str, dropped[:10]))}{', ...' if len(dropped) > 10 else ''})",
              file=sys.stderr, flush=True)
    sizes = {split: (found.kept if split == "train" else found.pairs)
             for split, found in scans.items()}
    if shards > sizes["train"]:
        raise PrepareError(f"--shards {shards}: more shards than the {sizes['train']} training "
                           f"pairs")

    window = 2 * workers
    # the tokenised text beside DEST until BPE is learnt: DEST stays untouched until then
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    with streaming.pool(workers) as workers_pool, tempfile.TemporaryDirectory(
            prefix=os.path.basename(os.path.abspath(dest)) + ".tokenised-", dir=parent) as tok:
        for split, pair in paths.items():
            counts = streaming.tokenise(
                pair, [os.path.join(tok, f"{split}.{lang}") for lang in langs], langs,
                sizes[split], split == "train", workers_pool, window, f"tokenise {split}",
                count_lines=(min(bpe_sample_lines or sizes["train"], sizes["train"])
                             if split == "train" else 0))
            if split == "train":
                codes = streaming.learn_bpe(counts, bpe_merges, f"learn joint BPE on train."
                                            f"{source_lang} + train.{target_lang}")
        learnt = codes.count("\n") - 1  # "#version: 0.2", then a merge per line
        if learnt < 1:
            raise PrepareError(f"no pair of symbols occurs twice in train.{source_lang} + "
                               f"train.{target_lang}, so BPE learnt no merge: give more text")
        if learnt < bpe_merges:
            print(f"BPE learnt {learnt} of the {bpe_merges} merges asked for: no other pair of "
                  f"symbols occurs twice in the training text", file=sys.stderr, flush=True)

        if replace:  # only once the input is known to be good
            remove_earlier_preparation(dest)
        os.makedirs(dest, exist_ok=True)
        open(os.path.join(dest, MARKER), "w").close()
        text, raw = os.path.join(dest, "text"), os.path.join(dest, "raw")
        os.makedirs(text)
        os.makedirs(raw)
        # raw valid/test text: the references for detokenised sacreBLEU
        for split in ("valid", "test"):
            for lang, path in zip(langs, paths[split]):
                with open(os.path.join(raw, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                    f.writelines(line + "\n" for line in streaming.normalised_lines(path))
        with open(os.path.join(dest, "bpe.codes"), "w", encoding="utf-8") as f:
            f.write(codes)
        for split in paths:
            for lang in langs:
                streaming.apply_bpe(codes, os.path.join(tok, f"{split}.{lang}"),
                                    os.path.join(text, f"{split}.{lang}"), sizes[split],
                                    workers_pool, window, f"apply BPE {split}.{lang}")
    binarise(dest, langs, workers, shards, sizes["train"])

    settings = {"source_lang": source_lang, "target_lang": target_lang, "bpe": "subword_nmt",
                "bpe_codes": "bpe.codes", "bpe_merges": bpe_merges, "bpe_merges_learnt": learnt,
                "tokenizer": "moses", "splits": sizes,
                "train_pairs_left_out_empty": len(dropped)}
    if bpe_sample_lines:
        settings["bpe_sample_lines"] = bpe_sample_lines
    if shards > 1:
        settings["shards"] = shards
        settings["data"] = ":".join(os.path.join(dest, f"shard{i}") for i in range(shards))
    with open(os.path.join(dest, "prepare.json.part"), "w") as f:  # whole, or not at all
        json.dump(settings, f, indent=2)
    os.replace(os.path.join(dest, "prepare.json.part"), os.path.join(dest, "prepare.json"))
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
    args = p.parse_args(argv)

    corpus = CORPORA.get(args.corpus, {})
    src = args.source_lang or corpus.get("source_lang")
    tgt = args.target_lang or corpus.get("target_lang")
    if not (src and tgt):
        p.error("give --source-lang and --target-lang, or a named --corpus")
    splits = dict(corpus.get("splits", {"train": "train", "valid": "valid", "test": "test"}))
    for split in splits:
        if getattr(args, split):
            splits[split] = getattr(args, split)
    raw_dir = args.raw_dir or corpus.get("bundled")
    dest = os.path.normpath(args.dest)  # DEST/ and DEST: DEST.raw, not DEST/.raw
    try:
        check_languages(src, tgt)
        # before anything is fetched, unpacked or converted
        check_destination(dest, raw_dir or dest + ".raw", args.force)
        if "archive" in corpus:  # iwslt14: an archive to fetch (or given) and convert
            unpacked = own_folder(dest + ".download", "the downloaded and unpacked archive")
            archive = raw_dir or fetch(corpus["archive"], unpacked)
            raw_dir = iwslt14_to_raw(archive, own_folder(dest + ".raw", "the converted text"),
                                     src, tgt, unpack_dir=unpacked)
        elif args.raw_dir is None and "bundled" in corpus and not os.path.isdir(raw_dir):
            raise PrepareError(f"--corpus {args.corpus} reads {raw_dir} of this repository, "
                               f"which is not here: run annotated-prepare in the repository's "
                               f"root, or pass --raw-dir PATH/{raw_dir}")
        elif raw_dir is None:
            if "download" not in corpus:
                p.error("give --raw-dir (or a named --corpus)")
            raw_dir = dest + ".raw"
            download(args.corpus, raw_dir)
        settings = prepare(raw_dir, dest, src, tgt, splits, args.bpe_merges, args.workers,
                           args.force, args.shards, args.bpe_sample_lines)
    except (KeyboardInterrupt, Stopped) as stop:  # what the rerun should do (command)
        stop.note = (f"an unfinished preparation is left in {dest}: run the same command with "
                     f"--force to prepare it again" if earlier_preparation(dest)
                     else f"nothing was written to {dest}")
        raise
    print(f"prepared {dest}: " + ", ".join(f"{s} {n} pairs"
                                            for s, n in settings["splits"].items()))


if __name__ == "__main__":
    main()
