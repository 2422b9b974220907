"""The benchmark's data: the bundled Tatoeba sample prepared as the demo prepares it, or a
generated corpus; the padding share of fairseq's batches; the first sentences of a test set."""

import os
import pathlib
import random
import shutil
import subprocess

from fairseq_plugin.cli.common import fairseq_cli


def make_data(work, n_train, n_test, vocab, seed=1):
    """--data synthetic: a Zipf-like vocabulary, source and target lengths (8-40) drawn apart."""
    rng = random.Random(seed)
    raw = os.path.join(work, "raw")
    os.makedirs(raw, exist_ok=True)
    weights = [1.0 / (r ** 1.1) for r in range(1, vocab + 1)]
    words = [f"w{r}" for r in range(vocab)]
    for split, n in (("train", n_train), ("valid", 200), ("test", n_test)):
        for lang in ("src", "tgt"):
            with open(os.path.join(raw, f"{split}.{lang}"), "w") as f:
                for _ in range(n):
                    f.write(" ".join(rng.choices(words, weights, k=rng.randint(8, 40))) + "\n")
    dest = os.path.join(work, "data-bin")
    subprocess.run([fairseq_cli("fairseq-preprocess"), "--source-lang", "src", "--target-lang",
                    "tgt", "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid",
                    "--testpref", f"{raw}/test", "--destdir", dest, "--joined-dictionary",
                    "--workers", "2"], check=True, capture_output=True)
    return dest


def tatoeba_sample():
    """The Tatoeba sample bundled in this package's checkout (examples/tatoeba/data), found from
    the working directory upwards, or beside this package where it runs from a checkout."""
    for start in (os.getcwd(), os.path.dirname(os.path.abspath(__file__))):
        folders = [start] + [str(p) for p in pathlib.Path(start).parents]
        for raw in (os.path.join(f, "examples", "tatoeba", "data") for f in folders):
            if os.path.isdir(raw):
                return raw
    raise SystemExit("benchmark: error: --data tatoeba: the Tatoeba sample (examples/tatoeba/data "
                     "of this package's checkout) is not above the working directory; run from "
                     "the checkout, or give --data-bin DIR (annotated-prepare) or --data synthetic")


def prepare_tatoeba(work):
    """The bundled Tatoeba sample, prepared as scripts/translation_demo.py prepares it."""
    from fairseq_plugin.cli.prepare import Preparation, prepare

    dest = os.path.join(work, "tatoeba-bin")
    prepare(Preparation(tatoeba_sample(), dest, "de", "en", bpe_merges=6000, force=True))
    return dest


def batch_padding(data_bin, max_tokens, split="train"):
    """(source, target) share of padded positions in fairseq-train's batches of ``split`` (fairseq's
    own length ordering and batching, --required-batch-size-multiple 8), and the sentences in
    the test set."""
    from fairseq.data import Dictionary, LanguagePairDataset, data_utils

    src, tgt = data_utils.infer_language_pair(data_bin)
    d_src = Dictionary.load(os.path.join(data_bin, f"dict.{src}.txt"))
    d_tgt = Dictionary.load(os.path.join(data_bin, f"dict.{tgt}.txt"))
    load = lambda s, lang, d: data_utils.load_indexed_dataset(  # noqa: E731
        os.path.join(data_bin, f"{s}.{src}-{tgt}.{lang}"), d)
    s_ds, t_ds = load(split, src, d_src), load(split, tgt, d_tgt)
    pairs = LanguagePairDataset(s_ds, s_ds.sizes, d_src, t_ds, t_ds.sizes, d_tgt)
    batches = pairs.batch_by_size(pairs.ordered_indices(), max_tokens=max_tokens,
                                  required_batch_size_multiple=8)
    shares = []
    for sizes in (s_ds.sizes, t_ds.sizes):
        real = sum(int(sizes[b].sum()) for b in batches)
        total = sum(len(b) * int(sizes[b].max()) for b in batches)
        shares.append(1.0 - real / total)
    return shares[0], shares[1], len(load("test", src, d_src))


def first_test_sentences(data_bin, n, work):
    """A data-bin under ``work`` whose test set is the first n sentence pairs of ``data_bin``'s
    (its dictionaries copied), for decoding n sentences (fairseq-generate has no option for a part
    of a split: its --num-shards follows --distributed-world-size, not the flag)."""
    from fairseq.data import Dictionary, data_utils, indexed_dataset

    src, tgt = data_utils.infer_language_pair(data_bin)
    dest = os.path.join(work, f"test-first-{n}")
    os.makedirs(dest, exist_ok=True)
    for lang in (src, tgt):
        shutil.copy(os.path.join(data_bin, f"dict.{lang}.txt"), dest)
        dictionary = Dictionary.load(os.path.join(data_bin, f"dict.{lang}.txt"))
        prefix = f"test.{src}-{tgt}.{lang}"
        sentences = data_utils.load_indexed_dataset(os.path.join(data_bin, prefix), dictionary)
        if getattr(sentences, "supports_prefetch", False):  # --dataset-impl cached / lazy
            sentences.prefetch(range(n))
        out = os.path.join(dest, prefix)
        builder = indexed_dataset.make_builder(indexed_dataset.data_file_path(out), impl="mmap",
                                               vocab_size=len(dictionary))
        for i in range(n):
            builder.add_item(sentences[i])
        builder.finalize(indexed_dataset.index_file_path(out))
    return dest
