"""Follow fairseq-train's log on stdin: every line passes through, and each interval line is
followed by a progress line with the updates/s and the time left (for a log piped to a file).

  PYTHONUNBUFFERED=1 fairseq-train ... --log-format simple 2>&1 | tee train.log \\
      | python -m fairseq_plugin.cli.follow --epochs 20
"""

import argparse
import sys

from .common import training_progress


def follow(lines, out, epochs=None) -> None:
    for line in lines:
        out.write(line)
        progress = training_progress(line, epochs)
        if progress is not None:
            out.write(f"  {progress}\n")
        out.flush()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, help="--max-epoch of the run, for the time left in all")
    follow(sys.stdin, sys.stdout, p.parse_args(argv).epochs)


if __name__ == "__main__":
    main()
