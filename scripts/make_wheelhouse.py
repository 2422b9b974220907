#!/usr/bin/env python
"""Build a wheelhouse on a connected machine, to install this package on a GPU node offline.

The node is assumed to have Python and torch already (as GPU images do). The wheelhouse holds
this package's wheel and the dependencies that such an image usually lacks, built for the
node's Python and platform (which may differ from this machine's):

  scripts/make_wheelhouse.py wheelhouse --python-version 3.12
  # copy wheelhouse/ to the node, then there:
  python3 -m pip install --no-index --find-links wheelhouse fairseq-annotated-transformer

pip checks every requirement against the node's own packages (torch, numpy, ...) and the
wheelhouse, and names any that neither has (fairseq also needs scikit-learn, Cython and
torchaudio, which GPU images often carry): add those with --with (and what they need), e.g.
--with scikit-learn cython. Packages only published as source (antlr4's runtime) are built
into pure-Python wheels here.
"""

import argparse
import glob
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# binary wheels for the node's Python; fairseq-fixed is the fairseq that imports on Python >= 3.11
BINARY = ["fairseq-fixed==0.12.3.1", "bitarray", "cffi", "pycparser", "hydra-core==1.3.2",
          "omegaconf==2.3.0", "PyYAML", "sacremoses", "subword-nmt", "sacrebleu", "portalocker",
          "regex", "tabulate", "colorama", "lxml", "click", "joblib", "tqdm", "mock", "packaging"]
SOURCE_ONLY = ["antlr4-python3-runtime==4.9.3"]  # needed by omegaconf 2.3
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def pip(*args):
    print("$ pip " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("dest")
    p.add_argument("--python-version", default="3.12", help="the node's Python, e.g. 3.12")
    p.add_argument("--with", dest="extra", nargs="+", default=[], metavar="REQUIREMENT",
                   help="more packages the node lacks, with what they need (e.g. scikit-learn)")
    p.add_argument("--force", action="store_true",
                   help="remove the wheels already in DEST first (a rebuild)")
    args = p.parse_args(argv)
    earlier = sorted(glob.glob(os.path.join(args.dest, "*.whl")))
    if earlier and not args.force:  # two versions of a package would make pip refuse them all
        p.error(f"{args.dest} already holds {len(earlier)} wheels; pass --force to replace them, "
                f"or give a new DEST")
    for wheel in earlier:
        os.remove(wheel)
    os.makedirs(args.dest, exist_ok=True)
    platform = [f for name in PLATFORMS for f in ("--platform", name)]
    for_node = ["--only-binary=:all:", "--python-version", args.python_version,
                "--implementation", "cp", *platform, "-d", args.dest]
    pip("download", "--no-deps", *for_node, *BINARY)
    if args.extra:  # with what they need
        pip("download", *for_node, *args.extra)
    pip("wheel", "--no-deps", "-w", args.dest, *SOURCE_ONLY)
    pip("wheel", "--no-deps", "-w", args.dest, REPO)
    wheels = sorted(glob.glob(os.path.join(args.dest, "*.whl")))
    size = sum(os.path.getsize(w) for w in wheels) / 2 ** 20
    print(f"{len(wheels)} wheels, {size:.0f} MB in {args.dest}; on the node: "
          f"python3 -m pip install --no-index --find-links {args.dest} fairseq-annotated-transformer")


if __name__ == "__main__":
    main()
