"""annotated-prepare's text stages, streamed a chunk at a time over a pool of processes.

Each stage reads its input in chunks of ``CHUNK_LINES`` lines, lets the pool's workers turn each
chunk into output, and writes the results to disk in the input's order as they arrive, with at
most two chunks a worker in flight. Memory holds a few chunks (and, for BPE, the training text's
word counts: its vocabulary) whatever the corpus's size, and the output is byte for byte the
same for any number of workers. With one worker the stages run in this process.

The stages: ``scan`` (read both sides once: count the pairs, refuse text that is not UTF-8 and
sides of different lengths, find the pairs with an empty side), ``tokenise`` (fairseq's Moses
tokenizer; the training text's word counts on the way), ``learn_bpe`` (subword-nmt from those
counts, as it learns from a dictionary of counts) and ``apply_bpe``.
"""

import collections
import contextlib
import functools
import gzip
import io
import itertools
import multiprocessing
import os
import sys
from typing import List, NamedTuple

from ..errors import PrepareError
from ..signals import pool_worker_signals
from .common import Progress

CHUNK_LINES = 2000


def text_path(path: str) -> str:
    """PATH, or PATH.gz where only that exists."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        return path + ".gz"
    return path


def open_text(path):
    """A plain or gzipped UTF-8 text file (PATH or PATH.gz), without a leading byte-order mark.
    Lines end at "\\n" only: a carriage return inside a line (which Python's universal newlines
    would take for a line end, misaligning a parallel corpus) stays in it, to become a space."""
    path = text_path(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="\n")
    return open(path, encoding="utf-8-sig", newline="\n")


def not_utf8(path) -> str:
    """Where the first byte that is not UTF-8 stands in ``path`` (plain or gzipped)."""
    path = text_path(path)
    with (gzip.open(path) if path.endswith(".gz") else open(path, "rb")) as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"byte {line[e.start]:#x} at line {number}, byte {e.start + 1}"
    return "an undecodable byte"


def normalised_lines(path):
    """A file's lines with tabs, carriage returns and runs of spaces made one space, edges
    stripped; one line for a file that cannot be read as UTF-8 text."""
    try:
        with open_text(path) as f:
            for line in f:
                yield " ".join(line.split())
    except UnicodeDecodeError as e:
        raise PrepareError(f"{text_path(path)} is not UTF-8 text ({not_utf8(path)}); convert "
                           f"it, e.g. iconv -f latin1 -t utf-8") from e
    except (OSError, EOFError) as e:  # a directory, a truncated or false .gz, ...
        raise PrepareError(f"cannot read {text_path(path)} ({e}); give plain or gzipped UTF-8 "
                           f"text") from e


class Scan(NamedTuple):
    pairs: int  # all lines
    kept: int  # pairs with both sides
    empty_lines: List[int]  # the first line numbers (from 1) of pairs with an empty side


class Split(NamedTuple):
    """One split of a scanned parallel corpus, as the stages read it."""
    name: str  # train, valid, test
    paths: List[str]  # its two files: source side, target side
    pairs: int  # the pairs the stages write
    drop_empty: bool  # the pairs with an empty side left out (the training text's)
    left_out: int = 0  # how many, where drop_empty


def scan(paths) -> Scan:
    """Read a parallel corpus once: how many pairs, and which have an empty side; one line for
    sides of different lengths."""
    pairs, empty = 0, []
    for pairs, (a, b) in enumerate(itertools.zip_longest(*map(normalised_lines, paths)), 1):
        if a is None or b is None:
            counts = [sum(1 for _ in normalised_lines(p)) for p in paths]
            raise PrepareError(f"{paths[0]} has {counts[0]} lines but {paths[1]} has "
                               f"{counts[1]}: parallel files must be aligned line by line")
        if not a or not b:
            empty.append(pairs)
    return Scan(pairs, pairs - len(empty), empty)


def chunks(lines, size: int = 0):
    """Lists of ``size`` (default CHUNK_LINES) items, the last one shorter."""
    size = size or CHUNK_LINES
    iterator = iter(lines)
    while True:
        chunk = list(itertools.islice(iterator, size))
        if not chunk:
            return
        yield chunk


def pair_chunks(paths, drop_empty: bool, size: int = 0):
    """(source lines, target lines) chunks of a scanned corpus, without the pairs with an empty
    side where ``drop_empty``."""
    pairs = zip(*map(normalised_lines, paths))
    if drop_empty:
        pairs = ((a, b) for a, b in pairs if a and b)
    for chunk in chunks(pairs, size):
        yield [a for a, _ in chunk], [b for _, b in chunk]


class InProcess:
    """The pool's interface, run in this process (one worker)."""

    class Done:
        def __init__(self, value):
            self.value = value

        def get(self):
            return self.value

    def apply_async(self, function, args):
        return self.Done(function(*args))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def pool(workers: int):
    """``workers`` processes (a context manager that stops them on leaving, on an interrupt
    too), or this process for one."""
    # (Ctrl-C reaches the workers too: the parent stops them, without their tracebacks)
    return InProcess() if workers == 1 else multiprocessing.Pool(workers, pool_worker_signals)


class Workers(NamedTuple):
    """The processes every stage runs on, and how many chunks may be in flight at once."""
    pool: object  # multiprocessing.Pool, or InProcess
    window: int


@contextlib.contextmanager
def workers(n: int):
    """``n`` worker processes (this process for one) with two chunks each in flight."""
    with pool(n) as running:
        yield Workers(running, 2 * n)


def in_order(workers: Workers, function, items):
    """``function(item)`` of each item on the workers, yielded in the items' order, with at most
    ``workers.window`` items in flight (the input is read no faster than the workers work)."""
    pending = collections.deque()
    for item in items:
        pending.append(workers.pool.apply_async(function, (item,)))
        if len(pending) >= workers.window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def moses_tokenizer(lang):
    """fairseq's own ``--tokenizer moses`` for ``lang`` (sacremoses with aggressive dash splits and
    XML escaping, no punctuation normalisation): fairseq-interactive and the hub tokenise new
    text exactly as the training data was."""
    from fairseq.data.encoders.moses_tokenizer import MosesTokenizer, MosesTokenizerConfig

    return MosesTokenizer(MosesTokenizerConfig(source_lang=lang, target_lang=lang)).encode


@functools.lru_cache(maxsize=None)
def _tokenizer(lang):
    return moses_tokenizer(lang)


def tokenise_chunk(job):
    """(languages, chunk of both sides, n) -> each side's tokenised text and the word counts of
    its first n lines."""
    langs, sides, counted = job
    out = []
    for lang, lines in zip(langs, sides):
        tokenise = _tokenizer(lang)
        tokenised = [tokenise(line) for line in lines]
        words = collections.Counter(w for line in tokenised[:counted] for w in line.split())
        out.append(("".join(line + "\n" for line in tokenised), words))
    return out


def tokenise(split: Split, out_paths, langs, workers: Workers, count_lines: int = 0):
    """Tokenise a scanned split into ``out_paths``; the word counts of each side's first
    ``count_lines`` lines (each side's words in the order first seen)."""
    counts = [collections.Counter(), collections.Counter()]

    def jobs():
        left = count_lines
        for sides in pair_chunks(split.paths, split.drop_empty):
            counted = min(left, len(sides[0]))
            left -= counted
            yield langs, sides, counted

    files = [open(p, "w", encoding="utf-8") for p in out_paths]
    try:
        with Progress(f"tokenise {split.name}", split.pairs, "pairs") as shown:
            for result in in_order(workers, tokenise_chunk, jobs()):
                for f, counter, (text, words) in zip(files, counts, result):
                    f.write(text)
                    counter.update(words)
                shown.update(text.count("\n"))  # (both sides have as many lines)
    finally:
        for f in files:
            f.close()
    return counts


class CountingMerges:
    """The file subword-nmt's learn_bpe writes its merges to, counting them for Progress (in a
    log, where subword-nmt's own bar would be one line of carriage returns)."""

    def __init__(self, out, shown: Progress):
        self.out, self.shown = out, shown

    def write(self, text: str) -> None:
        self.out.write(text)
        if not text.startswith("#"):  # "#version: 0.2" comes first
            self.shown.update(text.count("\n"))


def learn_bpe(counts, merges: int, desc: str) -> str:
    """Joint BPE codes learnt by subword-nmt from word counts (source side's words first, then
    the target's new ones, each in the order first seen: the order, and so the merges, that
    learning from the text itself gives)."""
    from subword_nmt import learn_bpe as subword_nmt

    joint = collections.Counter()
    for counter in counts:
        joint.update(counter)
    vocabulary = io.StringIO("".join(f"{w} {n}\n" for w, n in joint.items()))
    codes = io.StringIO()
    if sys.stderr.isatty():  # subword-nmt draws its own bar
        subword_nmt.learn_bpe(vocabulary, codes, merges, is_dict=True)
    else:  # our lines instead of its bar, which would be one line of carriage returns in a
        # log: subword-nmt's stderr (its bar, and its note when it stops early, which the
        # preparation gives in its own words) goes to nothing while it learns
        with Progress(desc, merges, "merges") as shown, open(os.devnull, "w") as nothing, \
                contextlib.redirect_stderr(nothing):
            subword_nmt.learn_bpe(vocabulary, CountingMerges(codes, shown), merges, is_dict=True)
    return codes.getvalue()


_bpe = None  # (codes, subword-nmt's BPE of them): each worker makes it once


def bpe_chunk(job):
    codes, lines = job
    global _bpe
    if _bpe is None or _bpe[0] != codes:
        from subword_nmt.apply_bpe import BPE

        _bpe = (codes, BPE(io.StringIO(codes)))
    return "".join(_bpe[1].process_line(line.rstrip("\n")) + "\n" for line in lines)


def apply_bpe(codes: str, in_path: str, out_path: str, total: int, workers: Workers,
              desc: str) -> None:
    with open(in_path, encoding="utf-8", newline="\n") as f, \
            open(out_path, "w", encoding="utf-8") as out, Progress(desc, total) as shown:
        jobs = ((codes, chunk) for chunk in chunks(f))
        for text in in_order(workers, bpe_chunk, jobs):
            out.write(text)
            shown.update(text.count("\n"))


def split_into_shards(path: str, shards: int, total: int, out_pattern: str) -> None:
    """PATH's lines into ``shards`` files of consecutive lines (out_pattern.format(i))."""
    bounds = [total * i // shards for i in range(shards + 1)]
    with open(path, encoding="utf-8", newline="\n") as f:
        for i in range(shards):
            with open(out_pattern.format(i), "w", encoding="utf-8") as out:
                out.writelines(itertools.islice(f, bounds[i + 1] - bounds[i]))

