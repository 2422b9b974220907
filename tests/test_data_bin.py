"""A damaged data-bin is named before training or decoding starts (fairseq_plugin/data_bin.py):
a split whose .bin or .idx was cut short ends fairseq-train and fairseq-generate in one line naming
its files, what the index promised and what is there; a whole data-bin loads as before."""

import os
import shutil

import numpy as np
import pytest
from fairseq.data import Dictionary, data_utils

from conftest import PLUGIN_DIR, assert_one_line_error, cli, reverse_data_bin, tiny_training
from fairseq_plugin import PluginError, data_bin as checks, fairseq_changes


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return reverse_data_bin(tmp_path_factory.mktemp("data_bin"), "--train", 300, "--valid", 30,
                            "--test", 20)


def cut_short(data_bin, tmp_path, name, by):
    """A copy of the data-bin whose file ``name`` lost its last ``by`` bytes."""
    copy = tmp_path / "cut"
    shutil.copytree(data_bin, copy)
    size = os.path.getsize(copy / name)
    os.truncate(copy / name, size - by)
    return copy


@pytest.mark.main_lane  # (the second lane: the check against its fairseq's loader, below)
def test_a_bin_cut_short_stops_training_and_decoding_before_they_start(whole, tmp_path):
    train = cut_short(whole, tmp_path, "train.src-tgt.src.bin", 10)
    proc = cli("fairseq-train", *tiny_training(train, tmp_path / "checkpoints", "--max-epoch", "1"),
               check=False)
    line = assert_one_line_error(
        proc, f"the data-bin's split {train}/train.src-tgt.src is damaged: ",
        f"{train}/train.src-tgt.src.idx puts its 300 sentences in ",
        f"bytes of {train}/train.src-tgt.src.bin, which holds ", "binarise it again")
    assert proc.returncode == 1 and "num_updates" not in proc.stdout + proc.stderr, line
    test = cut_short(whole, tmp_path / "t", "test.src-tgt.tgt.bin", 1)
    model = cli("fairseq-train", *tiny_training(whole, tmp_path / "model", "--max-update", "1"))
    assert model.returncode == 0
    proc = cli("fairseq-generate", test, "--user-dir", PLUGIN_DIR, "--path",
               tmp_path / "model" / "checkpoint_last.pt", "--cpu", "--max-tokens", "1000",
               check=False)
    assert_one_line_error(proc, f"the data-bin's split {test}/test.src-tgt.tgt is damaged")
    assert "H-0" not in proc.stdout


def test_an_idx_cut_short_is_named_with_what_it_promised(whole, tmp_path):
    cut = cut_short(whole, tmp_path, "valid.src-tgt.src.idx", 8)
    d = Dictionary.load(str(cut / "dict.src.txt"))
    with pytest.raises(PluginError, match=r"valid.src-tgt.src.idx promises 30 sentences, 386 "
                                          r"bytes, but holds 378 \(cut short by an interrupted "
                                          r"copy\?\); binarise it again"):
        data_utils.load_indexed_dataset(str(cut / "valid.src-tgt.src"), d, "mmap")
    os.truncate(cut / "valid.src-tgt.src.idx", 12)
    assert checks.damage(str(cut / "valid.src-tgt.src")).endswith("ends inside its header "
                                                                  "(12 bytes)")


def test_a_whole_data_bin_loads_as_before(whole):
    d = Dictionary.load(str(whole / "dict.src.txt"))
    for split in ("train", "valid", "test"):
        prefix = str(whole / f"{split}.src-tgt.src")
        assert checks.damage(prefix) is None
        checked = data_utils.load_indexed_dataset(prefix, d, "mmap")
        with fairseq_changes.removed("damaged_data_bin_in_one_line"):
            plain = data_utils.load_indexed_dataset(prefix, d, "mmap")
        assert len(checked) == len(plain) > 0
        assert all(checked[i].tolist() == plain[i].tolist() for i in range(len(plain)))


def test_fairseq_loads_a_bin_cut_short_without_a_word_only_without_the_change(whole, tmp_path):
    """fairseq's own loader takes the damaged split; the damage shows only when a batch reaches
    its last sentences, as numpy's error with no file named (which of two: where the cut fell)."""
    cut = cut_short(whole, tmp_path, "train.src-tgt.src.bin", 10)
    d = Dictionary.load(str(cut / "dict.src.txt"))
    prefix = str(cut / "train.src-tgt.src")
    with fairseq_changes.removed("damaged_data_bin_in_one_line"):
        dataset = data_utils.load_indexed_dataset(prefix, d, "mmap")
        with pytest.raises(ValueError, match="buffer is smaller than requested size|offset must "
                                             "be non-negative and no greater than buffer length"):
            [dataset[i] for i in range(len(dataset))]
    with pytest.raises(PluginError, match=f"split {prefix} is damaged"):
        data_utils.load_indexed_dataset(prefix, d, "mmap")


def test_the_check_reads_the_index_of_a_wmt_size_split_right(tmp_path):
    """An index of 4.5 million sentences (WMT14 en-de's size), written as fairseq writes it, over a
    sparse .bin: the check finds the end it promises, and a byte less is damage."""
    n = 4_500_000
    sizes = np.random.default_rng(0).integers(1, 120, n, dtype=np.int32)
    pointers = np.zeros(n, dtype=np.int64)
    pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64) * 2)  # uint16 token ids
    prefix = str(tmp_path / "train.en-de.en")
    with open(prefix + ".idx", "wb") as f:
        f.write(checks.HEADER.pack(checks.MAGIC, 1, 8, n))  # code 8: uint16
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
    end = int(pointers[-1] + sizes[-1] * 2)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(end)
    assert checks.damage(prefix) is None
    os.truncate(prefix + ".bin", end - 1)
    assert f"in {end:,} bytes of {prefix}.bin, which holds {end - 1:,}" in checks.damage(prefix)
