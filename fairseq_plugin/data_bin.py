"""A damaged data-bin is named before training or decoding starts.

fairseq-preprocess writes each binarised split as two files: PREFIX.bin, every sentence's token
ids one after the other, and PREFIX.idx, a header, then each sentence's length and where it
starts in the .bin. fairseq 0.12 maps both into memory and trusts them: a .bin cut short (an
interrupted copy or rsync of a data-bin) fails only when a batch reaches a missing sentence,
deep inside training, with numpy's "offset must be non-negative and no greater than buffer
length" and no file named; an .idx cut short fails as it loads, as obscurely.

Here each split is checked as it loads (fairseq-train, fairseq-generate and every command that
loads a split through fairseq): the .idx holds as many lengths and start positions as its header
promises, and its last sentence ends inside the .bin. The check reads the header and one entry of
each array, whatever the split's size. It covers fairseq's default format, ``mmap``; the older
``lazy``, ``cached`` and ``raw`` formats load as before.
"""

import os
import struct

import numpy as np
from fairseq.data.indexed_dataset import _code_to_dtype as TOKEN_TYPES  # the header's type code

from .errors import PluginError

MAGIC = b"MMIDIDX\x00\x00"  # fairseq's MMapIndexedDataset.Index header
HEADER = struct.Struct("<9sQBQ")  # magic, version, dtype code, number of sentences


def damage(prefix: str):
    """What is wrong with the split PREFIX.idx + PREFIX.bin, in words, or None when they agree
    (or when the .idx is not of the mmap format, which fairseq itself refuses)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)
    with open(idx, "rb") as f:
        header = f.read(HEADER.size)
        if header[:len(MAGIC)] != MAGIC[:len(header)]:
            return None  # another format: fairseq's own message about --dataset-impl
        if len(header) < HEADER.size:
            return f"{idx} ends inside its header ({idx_size} bytes)"
        _, _, code, n = HEADER.unpack(header)
        if code not in TOKEN_TYPES:
            return None  # fairseq's own error
        promised = HEADER.size + n * (4 + 8)  # n int32 lengths, then n int64 start positions
        if idx_size < promised:
            return (f"{idx} promises {n:,} sentences, {promised:,} bytes, but holds "
                    f"{idx_size:,}")
        if n == 0:
            return None
        f.seek(HEADER.size + (n - 1) * 4)
        last_length = int(np.frombuffer(f.read(4), dtype=np.int32)[0])
        f.seek(HEADER.size + n * 4 + (n - 1) * 8)
        last_start = int(np.frombuffer(f.read(8), dtype=np.int64)[0])
    needed = last_start + last_length * np.dtype(TOKEN_TYPES[code]).itemsize
    if bin_size < needed:
        return (f"{idx} puts its {n:,} sentences in {needed:,} bytes of {bin_}, which holds "
                f"{bin_size:,}")
    return None


def check_split(prefix: str) -> None:
    """One line for a split whose .idx and .bin disagree (a copy cut short)."""
    found = damage(prefix)
    if found:
        raise PluginError(f"the data-bin's split {prefix} is damaged: {found} (cut short by an "
                          f"interrupted copy?); binarise it again with fairseq-preprocess or "
                          f"annotated-prepare, or copy the data-bin again")


def checked_make_dataset(make_dataset):
    """fairseq's ``indexed_dataset.make_dataset`` (fairseq_changes.py), through which
    ``data_utils.load_indexed_dataset`` loads every binarised split."""
    def make(path, impl, *args, **kwargs):
        if impl == "mmap" and os.path.exists(path + ".idx") and os.path.exists(path + ".bin"):
            check_split(path)
        return make_dataset(path, impl, *args, **kwargs)
    return make
