"""The named corpora annotated-prepare knows (--corpus): where each one's raw text comes from.

- multi30k: downloaded (gzipped raw files), or read from --raw-dir;
- iwslt14: an archive downloaded (or given with --raw-dir), unpacked and converted to
  RAW/{train,valid,test}.{de,en} as fairseq's examples do;
- tatoeba: the sample bundled in this repository (examples/tatoeba/data).

``raw_text`` answers, for a command line, the folder of raw files the preparation reads.
"""

import gzip
import os
import re
import urllib.request

from ..errors import PrepareError
from ..outputs import own_folder

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


def raw_text(corpus_name, raw_dir, dest, src, tgt) -> str:
    """The folder of raw files PREFIX.LANG to prepare: ``raw_dir`` as given, or the named
    corpus's (fetched into DEST.raw, or unpacked and converted there, or bundled); one of the
    two is given."""
    corpus = CORPORA.get(corpus_name, {})
    if "archive" in corpus:  # iwslt14: an archive to fetch (or given) and convert
        unpacked = own_folder(dest + ".download", "the downloaded and unpacked archive")
        archive = raw_dir or fetch(corpus["archive"], unpacked)
        return iwslt14_to_raw(archive, own_folder(dest + ".raw", "the converted text"),
                              src, tgt, unpack_dir=unpacked)
    if raw_dir is not None:
        return raw_dir
    if "bundled" in corpus:
        if not os.path.isdir(corpus["bundled"]):
            raise PrepareError(f"--corpus {corpus_name} reads {corpus['bundled']} of this "
                               f"repository, which is not here: run annotated-prepare in the "
                               f"repository's root, or pass --raw-dir PATH/{corpus['bundled']}")
        return corpus["bundled"]
    download(corpus_name, dest + ".raw")  # (multi30k)
    return dest + ".raw"
