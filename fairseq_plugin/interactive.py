"""fairseq-interactive: skip empty and over-long input lines with a message, and go on; refuse
input that is not UTF-8 in one line, from stdin as from --input FILE.

Without this, an over-long line ends the whole session with fairseq's "Size of sample #0 is
invalid" error, and an empty line is "translated" from nothing. When the plugin is loaded by
fairseq-interactive (``--user-dir fairseq_plugin``), its ``make_batches`` is wrapped
(fairseq_changes.py): each such
line gets one message on stderr, the other lines are translated, and every output keeps the
number of its input line.
"""

import functools
import sys

import torch

from .errors import PluginError


def _preview(line: str, width: int = 40) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def check_utf8(lines) -> None:
    """One line for input that was not UTF-8: fairseq reads --input FILE as UTF-8 (refused at
    the first bad byte) but stdin in the locale's encoding, which keeps undecodable bytes as
    surrogates (PEP 383) that would be translated as <unk>."""
    for line in lines:
        bad = next((ch for ch in line if "\udc80" <= ch <= "\udcff"), None)
        if bad is not None:
            raise PluginError(f"the input is not UTF-8 text (byte {ord(bad) - 0xdc00:#x} in "
                              f'"{_preview(line)!s}"); convert it, e.g. iconv -f latin1 -t utf-8')


def checked_make_batches(make_batches):
    """fairseq-interactive's ``make_batches`` (fairseq_changes.py)."""

    @functools.wraps(make_batches)
    def wrapper(lines, cfg, task, max_positions, encode_fn):
        check_utf8(lines)
        limit = max_positions[0] if isinstance(max_positions, (tuple, list)) else max_positions
        # with --constraints a line is "source<TAB>constraint<TAB>...": only the source counts
        sources = [line.split("\t")[0] for line in lines] if cfg.generation.constraints else lines
        _, lengths = task.get_interactive_tokens_and_lengths(sources, encode_fn)
        keep = []
        for i, (line, n) in enumerate(zip(sources, lengths)):
            if not line.strip():
                sys.stderr.write("fairseq_plugin: skipped an empty input line: nothing to "
                                 "translate\n")
            elif limit is not None and n > limit:
                sys.stderr.write(
                    f'fairseq_plugin: skipped input "{_preview(line)}": {n} tokens, more than '
                    f"the model's {limit} (--max-source-positions); split it into shorter "
                    f"sentences\n")
            else:
                keep.append(i)
        sys.stderr.flush()
        if not keep:
            return
        original = torch.tensor(keep)
        for batch in make_batches([lines[i] for i in keep], cfg, task, max_positions, encode_fn):
            yield batch._replace(ids=original[batch.ids])

    return wrapper
