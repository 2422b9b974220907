"""Where a command's outputs may go: every rule, each refusal one line that says what to do.

An output is never written over one of the command's inputs (--force or not, through links too)
nor inside a folder the command reads (a data-bin: its dictionaries, BPE codes and raw references
stay as they are); a folder of other files is never emptied, not even with --force, which replaces
only what this package wrote there earlier (an earlier preparation, an earlier CTranslate2 model);
an existing output is replaced only with --force. What may be written is written whole
(checkpoints.write_whole).
"""

import os

from .errors import PluginError, PrepareError

# what CTranslate2's converter writes: --force replaces a directory holding only these
CTRANSLATE2_FILES = {"config.json", "model.bin", "shared_vocabulary.json", "source_vocabulary.json",
                     "target_vocabulary.json", "shared_vocabulary.txt", "source_vocabulary.txt",
                     "target_vocabulary.txt"}


MARKER = ".annotated-prepare"  # written first into DEST: --force replaces only a preparation
RAW_MARKER = ".annotated-prepare-raw"  # in a folder annotated-prepare made (DEST.raw, ...)


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one existing file (through links too)."""
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def check_output_file(path: str, force: bool, example: str, inputs=(), folders=()) -> None:
    """One line for an ``--output`` file that may not be written: one of the command's
    ``inputs`` (--force or not, through links too), a path inside one of the ``folders`` it
    reads (a data-bin: its dictionaries, BPE codes and raw references stay as they are), a
    directory (``example`` names a file in it), or an existing file without ``--force``."""
    if any(same_file(path, read) for read in inputs):
        raise PluginError(f"--output {path} is one of this command's inputs; give another path "
                          f"(inputs are kept)")
    check_outside("--output", path, folders)
    if os.path.isdir(path):
        raise PluginError(f"--output {path} is a directory; give a file name, e.g. "
                          f"{os.path.join(path, example)}")
    if os.path.exists(path) and not force:
        raise PluginError(f"{path} already exists; choose another output or pass --force")


def check_outside(option: str, path: str, folders) -> None:
    """One line for an output ``path`` that is one of the ``folders`` a command reads or lies
    inside one (links followed, also for a path not made yet)."""
    real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))),
                        os.path.basename(os.path.abspath(path)))
    real = os.path.realpath(real) if os.path.exists(path) else real
    for folder in folders:
        read = os.path.realpath(folder)
        if os.path.commonpath([real, read]) == read:
            raise PluginError(f"{option} {path} is inside {folder}, which this command reads; "
                              "give a path outside it (its files are kept)")


def check_output_folder(option: str, path: str, folders, what: str) -> None:
    """One line for a folder of outputs (``what``) that is inside one of the ``folders`` the
    command reads, or a file."""
    check_outside(option, path, folders)
    if os.path.exists(path) and not os.path.isdir(path):
        raise PluginError(f"{option} {path} is a file; give a directory for the {what}")


def check_ctranslate2_dir(path: str, output: str, force: bool) -> None:
    """One line for a --ctranslate2 directory that may not be written: one holding --output, a
    file or a link, a folder of other files than an earlier CTranslate2 model's (--force would
    replace it), or an earlier model without --force."""
    real = os.path.realpath(path)
    if os.path.realpath(output) == real or os.path.realpath(output).startswith(real + os.sep):
        raise PluginError(f"--ctranslate2 {path} would hold --output {output}; give the "
                          f"CTranslate2 model a directory of its own")
    if os.path.islink(path):
        raise PluginError(f"--ctranslate2 {path} is a symbolic link; give the directory itself")
    if os.path.exists(path) and not os.path.isdir(path):
        raise PluginError(f"--ctranslate2 {path} is a file; give a directory for the CTranslate2 "
                          f"model")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise PluginError(f"--ctranslate2 {path}: {parent} is a file, not a directory")
    if not os.path.isdir(path):
        return
    others = sorted(set(os.listdir(path)) - CTRANSLATE2_FILES)
    if others:
        raise PluginError(f"--ctranslate2 {path} holds files that are not a CTranslate2 model's "
                          f"(e.g. {others[0]}); --force replaces only an earlier CTranslate2 "
                          f"model: give a new directory")
    if not force:
        raise PluginError(f"{path} already exists; choose another --ctranslate2 or pass --force")


def earlier_preparation(dest) -> bool:
    """Whether DEST was written by annotated-prepare (finished or stopped half-way)."""
    return any(os.path.exists(os.path.join(dest, name)) for name in (MARKER, "prepare.json"))


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
    if not force and not os.path.exists(os.path.join(dest, "prepare.json")):
        raise PrepareError(f"{dest} holds an unfinished preparation (it was interrupted); pass "
                           f"--force to prepare it again, or choose another --dest")
    if not force:
        raise PrepareError(f"{dest} holds an earlier preparation; pass --force to replace it, or "
                           f"choose another --dest")
    if os.path.islink(dest):
        raise PrepareError(f"--dest {dest} is a symbolic link; give the directory it points to "
                           f"({os.path.realpath(dest)})")
    return True


def own_folder(path, what) -> str:
    """``path``, made if absent; refused when it exists and annotated-prepare did not make it
    (its files would be overwritten)."""
    if os.path.exists(path) and not os.path.exists(os.path.join(path, RAW_MARKER)):
        raise PrepareError(f"{path} exists and was not made by annotated-prepare, which writes "
                           f"{what} there; move it, or choose another --dest")
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, RAW_MARKER), "w").close()
    return path
