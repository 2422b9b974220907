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
import io
import json
import os
import re
import shutil
import sys
import urllib.request
from unittest import mock

from ..errors import PluginError, exit_in_one_line
from .common import Progress, fairseq_cli, progress, run

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


class PrepareError(PluginError):
    pass


MARKER = ".annotated-prepare"  # written first into DEST: --force replaces only a preparation


# what a preparation writes into DEST: ours, and fairseq-preprocess's dictionaries, binarised
# splits (train.de-en.de.bin, valid1.de-en.en.idx, ...; its workers' parts, train.de-en.de.pt1.bin,
# when it stopped before merging them) and log
PREPARATION_ENTRY = re.compile(
    r"\.annotated-prepare|prepare\.json|prepare\.log|bpe\.codes|text|raw|preprocess\.log"
    r"|dict\.[^.]+\.txt"
    r"|(train|valid\d*|test\d*)\.[^.]+-[^.]+\.[^.]+(\.pt\d+)?\.(bin|idx)")


def earlier_preparation(dest) -> bool:
    """Whether DEST was written by annotated-prepare (finished or stopped half-way)."""
    return any(os.path.exists(os.path.join(dest, name)) for name in (MARKER, "prepare.json"))


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


def open_text(path):
    """A plain or gzipped UTF-8 text file (PATH or PATH.gz), without a leading byte-order mark.
    Lines end at "\n" only: a carriage return inside a line (which Python's universal newlines
    would take for a line end, misaligning a parallel corpus) stays in it, to become a space."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="\n")
    return open(path, encoding="utf-8-sig", newline="\n")


def not_utf8(path) -> str:
    """Where the first byte that is not UTF-8 stands in ``path`` (plain or gzipped)."""
    gz = path if os.path.exists(path + ".gz") and not os.path.exists(path) else None
    with (gzip.open(gz + ".gz") if gz else open(path, "rb")) as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"byte {line[e.start]:#x} at line {number}, byte {e.start + 1}"
    return "an undecodable byte"


def exists(path):
    return os.path.exists(path) or os.path.exists(path + ".gz")


def read_parallel(raw_dir, prefix, src, tgt):
    """Read RAW/prefix.src and RAW/prefix.tgt; refuse missing, misaligned or empty input."""
    paths = [os.path.join(raw_dir, f"{prefix}.{lang}") for lang in (src, tgt)]
    for path in paths:
        if not exists(path):
            raise PrepareError(f"missing file {path} (or {path}.gz): expected "
                               f"RAW_DIR/{prefix}.{{{src},{tgt}}}, one sentence per line (other "
                               f"prefixes: --train, --valid, --test)")
    sides = []
    for path in paths:
        try:
            with open_text(path) as f:
                # tabs, carriage returns, edges -> one space
                sides.append([" ".join(line.split()) for line in f])
        except UnicodeDecodeError as e:
            raise PrepareError(f"{path} is not UTF-8 text ({not_utf8(path)}); convert it, "
                               f"e.g. iconv -f latin1 -t utf-8") from e
        except (OSError, EOFError) as e:  # a directory, a truncated or false .gz, ...
            raise PrepareError(f"cannot read {path} ({e}); give plain or gzipped UTF-8 "
                               f"text") from e
    if len(sides[0]) != len(sides[1]):
        raise PrepareError(f"{paths[0]} has {len(sides[0])} lines but {paths[1]} has "
                           f"{len(sides[1])}: parallel files must be aligned line by line")
    if not sides[0]:
        raise PrepareError(f"{paths[0]} and {paths[1]} are empty")
    empty = sum(1 for a, b in zip(*sides) if not a or not b)
    if empty == len(sides[0]):
        raise PrepareError(f"{paths[0]} / {paths[1]}: every pair has an empty side")
    return sides


def without_empty_pairs(sides):
    """The pairs of which neither side is empty, and the line numbers of the others (a sentence
    paired with nothing teaches the model to translate it into nothing)."""
    kept = [(a, b) for a, b in zip(*sides) if a and b]
    dropped = [i for i, (a, b) in enumerate(zip(*sides), 1) if not a or not b]
    return [[a for a, _ in kept], [b for _, b in kept]], dropped


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


RAW_MARKER = ".annotated-prepare-raw"  # in a folder annotated-prepare made (DEST.raw, ...)


def own_folder(path, what) -> str:
    """``path``, made if absent; refused when it exists and annotated-prepare did not make it
    (its files would be overwritten)."""
    if os.path.exists(path) and not os.path.exists(os.path.join(path, RAW_MARKER)):
        raise PrepareError(f"{path} exists and was not made by annotated-prepare, which writes "
                           f"{what} there; move it, or choose another --dest")
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, RAW_MARKER), "w").close()
    return path


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


class CountingMerges:
    """The file subword-nmt's learn_bpe writes its merges to, counting them for Progress (in a
    log, where subword-nmt's own bar would be one line of carriage returns)."""

    def __init__(self, out, shown: Progress):
        self.out, self.shown = out, shown

    def write(self, text: str) -> None:
        self.out.write(text)
        if not text.startswith("#"):  # "#version: 0.2" comes first
            self.shown.update(text.count("\n"))


def preprocess_summary(line: str):
    """fairseq-preprocess's summary of a binarised file ("[de] .../train.de: 3000 sents, ..."),
    or None."""
    summary = re.search(r"\[[^]]+\] \S+: \d+ sents, .*", line)
    return f"fairseq-preprocess {summary[0]}" if summary else None


def check_destination(dest, raw_dir, force) -> bool:
    """Whether DEST holds an earlier preparation to replace (once the input is read), or one
    line for a DEST the preparation may not write to."""
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise PrepareError(f"--dest {dest} is a file; give a directory (new or empty)")
    real_dest = os.path.realpath(dest)
    if os.path.commonpath([os.path.realpath(raw_dir), real_dest]) == real_dest:
        raise PrepareError(f"--raw-dir {raw_dir} is inside --dest {dest}, which the preparation "
                           f"replaces; give a --dest outside the raw text")
    if not (os.path.isdir(dest) and os.listdir(dest)):
        return False
    if not earlier_preparation(dest):
        raise PrepareError(f"{dest} is not empty and holds no earlier preparation (no "
                           f"prepare.json), so it is not replaced, not even with --force; "
                           f"choose another --dest")
    if not force:
        raise PrepareError(f"{dest} holds an earlier preparation; pass --force to replace it, or "
                           f"choose another --dest")
    if os.path.islink(dest):
        raise PrepareError(f"--dest {dest} is a symbolic link; give the directory it points to "
                           f"({os.path.realpath(dest)})")
    return True


def prepare(raw_dir, dest, source_lang, target_lang, splits, bpe_merges=8000, workers=2,
            force=False):
    """Tokenise (fairseq's moses tokenizer), learn and apply joint BPE, and binarise with
    fairseq-preprocess into DEST; returns the settings written to DEST/prepare.json. Bad input
    is refused in one line before DEST is touched."""
    from subword_nmt.apply_bpe import BPE
    from subword_nmt.learn_bpe import learn_bpe

    if bpe_merges < 1:
        raise PrepareError(f"--bpe-merges {bpe_merges}: give a number of merges of at least 1")
    if workers < 1:
        raise PrepareError(f"--workers {workers}: give at least 1 process")
    check_languages(source_lang, target_lang)
    replace = check_destination(dest, raw_dir, force)
    langs = (source_lang, target_lang)
    data = {split: read_parallel(raw_dir, prefix, *langs) for split, prefix in splits.items()}
    data["train"], dropped = without_empty_pairs(data["train"])
    if dropped:
        print(f"train: left out {len(dropped)} pairs with an empty side (lines "
              f"{', '.join(map(str, dropped[:10]))}{', ...' if len(dropped) > 10 else ''})",
              file=sys.stderr, flush=True)

    tokenised = {}
    for split, sides in data.items():
        tokenised[split] = []
        for lang, lines in zip(langs, sides):
            tokenise = moses_tokenizer(lang)
            tokenised[split].append(
                [tokenise(line) for line in progress(lines, f"tokenise {split}.{lang}")])

    codes = io.StringIO()
    train_text = tokenised["train"][0] + tokenised["train"][1]
    if sys.stderr.isatty():  # subword-nmt draws its own bar
        learn_bpe(train_text, codes, bpe_merges)
    else:  # our lines instead of its bar (one line of carriage returns in a log)
        without_bar = lambda iterable, *args, **kwargs: iterable  # noqa: E731
        with Progress(f"learn joint BPE on train.{source_lang} + train.{target_lang}",
                      bpe_merges, "merges") as shown, \
                mock.patch.object(sys.modules[learn_bpe.__module__], "tqdm", without_bar):
            learn_bpe(train_text, CountingMerges(codes, shown), bpe_merges)
    learnt = codes.getvalue().count("\n") - 1  # "#version: 0.2", then a merge per line
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
        for lang, lines in zip(langs, data[split]):
            with open(os.path.join(raw, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines)
    with open(os.path.join(dest, "bpe.codes"), "w", encoding="utf-8") as f:
        f.write(codes.getvalue())
    codes.seek(0)
    bpe = BPE(codes)
    for split, sides in tokenised.items():
        for lang, lines in zip(langs, sides):
            with open(os.path.join(text, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                for line in progress(lines, f"apply BPE {split}.{lang}"):
                    f.write(bpe.process_line(line) + "\n")

    cmd = [fairseq_cli("fairseq-preprocess"),
           "--source-lang", source_lang, "--target-lang", target_lang,
           "--trainpref", os.path.join(text, "train"), "--validpref", os.path.join(text, "valid"),
           "--testpref", os.path.join(text, "test"), "--destdir", dest, "--joined-dictionary",
           "--workers", str(workers)]
    # (fairseq-preprocess keeps its own log, DEST/preprocess.log: ours is another file)
    run(cmd, os.path.join(dest, "prepare.log"), show=preprocess_summary,
        echo=functools.partial(print, file=sys.stderr))

    settings = {"source_lang": source_lang, "target_lang": target_lang, "bpe": "subword_nmt",
                "bpe_codes": "bpe.codes", "bpe_merges": bpe_merges, "bpe_merges_learnt": learnt,
                "tokenizer": "moses", "splits": {s: len(data[s][0]) for s in data},
                "train_pairs_left_out_empty": len(dropped)}
    with open(os.path.join(dest, "prepare.json.part"), "w") as f:  # whole, or not at all
        json.dump(settings, f, indent=2)
    os.replace(os.path.join(dest, "prepare.json.part"), os.path.join(dest, "prepare.json"))
    return settings


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
    p.add_argument("--workers", type=int, default=2)
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
                           args.force)
    except PluginError as e:
        exit_in_one_line("annotated-prepare", e)
    print(f"prepared {dest}: " + ", ".join(f"{s} {n} pairs"
                                            for s, n in settings["splits"].items()))


if __name__ == "__main__":
    main()
