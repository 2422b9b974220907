"""One clear line for bad input.

Errors the user can fix (a bad flag combination, a sentence that is too long, a checkpoint that
cannot be read) raise :class:`PluginError`; fairseq's own "sentence too long" error already names
its fix and gets the same treatment, and so, in fairseq's own commands only, do a missing file
(a misspelled data-bin, dictionary, split or checkpoint) and input that is not UTF-8. Library
callers get a normal exception; on the command line (fairseq-train, fairseq-generate, ...) the
hook below prints only
``fairseq_plugin: error: <what is wrong and how to fix it>`` instead of a traceback, and exits
with status 1. ``FAIRSEQ_PLUGIN_TRACEBACK=1`` in the environment shows the full traceback instead.
fairseq-hydra-train reports errors itself: it prints a PluginError's message alone (a
``CompactHydraException``), and ``HYDRA_FULL_ERROR=1`` shows the traceback there.
"""

import dataclasses
import difflib
import functools
import os
import signal
import sys

from hydra.errors import CompactHydraException
from omegaconf.errors import ConfigKeyError

from .signals import (STOP_NAMES, Stopped, end_by_signal, raise_stopped_in,
                      running_a_fairseq_command)

TRACEBACK_VARIABLE = "FAIRSEQ_PLUGIN_TRACEBACK"

# fairseq re-raises a failed --restore-file as a new Exception with this message, inside the
# ``except`` block of the original error (which is then its __context__)
_FAIRSEQ_REWRAPS = ("Cannot load model parameters from checkpoint",)


class PluginError(ValueError, CompactHydraException):
    """A user-facing error whose message says what is wrong and how to fix it."""


class PrepareError(PluginError):
    """A PluginError of annotated-prepare (raised in outputs.py and cli/)."""


def spelling_hint(name: str, known, listed_in: str = "") -> str:
    """'did you mean X?' for the known name closest to a misspelled one, else where to look.
    (fairseq-train --help cannot list a model's options: it answers before adding them.)"""
    close = difflib.get_close_matches(name, list(known), n=1)
    if close:
        return f"did you mean {close[0]}?"
    return "check its spelling" + (f" ({listed_in} lists the options)" if listed_in else "")


def one_line_error(exc: BaseException):
    """The message to print alone, or None (a full traceback then).

    Our own errors, also when fairseq re-raises them (``raise ... from`` them, or the known
    re-raise of --restore-file); fairseq's "Size of sample #N is invalid ... skip this example
    with --skip-invalid-size-inputs-valid-test", which already says what is wrong and how to fix
    it. An unrelated error raised while a PluginError was being handled keeps its traceback.
    """
    seen = exc
    while seen is not None:
        if isinstance(seen, PluginError):
            return str(seen)
        if seen.__cause__ is not None:
            seen = seen.__cause__
        elif type(seen) is Exception and str(seen).startswith(_FAIRSEQ_REWRAPS):
            seen = seen.__context__
        else:
            break
    if type(exc) is Exception and str(exc).startswith("Size of sample #"):
        return str(exc)
    return None


def bad_input_message(exc: BaseException):
    """A fairseq command's missing file (a misspelled data-bin, checkpoint or language) as one
    line naming it and, where its folder exists, what that folder holds of its kind; an input
    that is not UTF-8; or None."""
    if isinstance(exc, UnicodeDecodeError):
        return (f"the input is not UTF-8 text ({exc.reason}: byte {exc.object[exc.start]:#x}); "
                f"convert it, e.g. iconv -f latin1 -t utf-8")
    if type(exc) is OSError and str(exc).startswith("Model file not found"):
        return f"{exc}; check --path"  # fairseq's checkpoint loading raises this
    if not isinstance(exc, FileNotFoundError):
        return None
    if not exc.filename:
        return f"{exc}; check the data-bin path, the split's name and the language flags"
    path = str(exc.filename)
    message = f"no such file or directory: {path}"
    folder, kind = os.path.dirname(path), os.path.basename(path).split(".")[0] + "."
    if folder and os.path.isdir(folder):
        held = sorted(name for name in os.listdir(folder) if name.startswith(kind))
        if held:
            message += f" ({folder} holds {', '.join(held[:6])}{', ...' if held[6:] else ''})"
    if kind == "dict.":  # fairseq looks for DATA_BIN/dict.LANG.txt
        return message + "; check the path and --source-lang / --target-lang"
    return message + "; check the path"


def exit_in_one_line(command: str, error: PluginError):
    """(``command`` below) Exit with ``COMMAND: error: <message>``, or re-raise for the full
    traceback when ``FAIRSEQ_PLUGIN_TRACEBACK=1``."""
    if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
        raise error
    sys.exit(f"{command}: error: {error}")


def print_plugin_errors_as_one_line(previous_hook):
    """sys.excepthook (fairseq_changes.py): an uncaught :class:`PluginError`, or in fairseq's
    commands a missing file or input that is not UTF-8, as one line; anything else as before."""
    def hook(exc_type, exc, tb):
        message = one_line_error(exc)
        if message is None and running_a_fairseq_command():
            message = bad_input_message(exc)
        quiet = os.environ.get(TRACEBACK_VARIABLE, "") in ("", "0")
        if isinstance(exc, (KeyboardInterrupt, Stopped)) and running_a_fairseq_command() and quiet:
            signum = getattr(exc, "signum", signal.SIGINT)
            end_by_signal(f"fairseq_plugin: {os.path.basename(sys.argv[0])} stopped by "
                          f"{STOP_NAMES[signum]}", signum)
        if message is not None and quiet:
            sys.stderr.write(f"fairseq_plugin: error: {message}\n")
            sys.stderr.flush()
        else:
            previous_hook(exc_type, exc, tb)

    return hook


def unknown_options_in_one_line(merge_with_dataclasses):
    """fairseq-train's ``add_defaults`` (fairseq_changes.py). fairseq-train and
    fairseq-hydra-train merge each configuration group (model, criterion, lr_scheduler, ...)
    with its config dataclass there right after importing the user dir; a misspelled key is an
    omegaconf ConfigKeyError at the end of a long traceback, and an unknown ``model._name`` (a
    YAML's or an override's) a KeyError from fairseq's own error message. Each becomes a
    PluginError naming it."""

    def add_defaults(cfg):
        from fairseq.models import ARCH_MODEL_NAME_REGISTRY, MODEL_REGISTRY

        model = cfg.get("model")
        name = model if isinstance(model, str) else getattr(model, "_name", None)
        if isinstance(name, str) and ARCH_MODEL_NAME_REGISTRY.get(name, name) not in MODEL_REGISTRY:
            presets = sorted(a for a in ARCH_MODEL_NAME_REGISTRY if a.startswith("annotated_"))
            raise PluginError(f"unknown model model._name={name}; the annotated_transformer "
                              f"presets are {', '.join(presets)}")
        try:
            return merge_with_dataclasses(cfg)
        except ConfigKeyError as e:
            config = getattr(e.object_type, "__name__", "its config")
            groups = [g for g in ("model", "criterion", "lr_scheduler", "optimizer", "task")
                      if hasattr(cfg.get(g), "keys") and e.key in cfg[g]]
            where = f"{groups[0]}.{e.key}" if groups else str(e.key)
            names = ([f.name for f in dataclasses.fields(e.object_type)]
                     if dataclasses.is_dataclass(e.object_type) else [])
            ours = getattr(e.object_type, "__module__", "").startswith("fairseq_plugin")
            listed_in = "docs/reference.md" if ours else ""
            raise PluginError(f"unknown option {where}: {config} has no field '{e.key}'; "
                              f"{spelling_hint(str(e.key), names, listed_in)}")

    return add_defaults


def max_tokens_checked(batch_by_size):
    """fairseq's ``data_utils.batch_by_size`` (fairseq_changes.py): --max-tokens below a
    sentence's tokens (its longer side with its end-of-sentence token: a batch holds whole
    sentences) is one line naming the sentence and the fix."""
    @functools.wraps(batch_by_size)
    def checked(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None, *args, **kwargs):
        if max_tokens and num_tokens_vec is not None and len(num_tokens_vec):
            longest = int(num_tokens_vec.argmax())
            if num_tokens_vec[longest] > max_tokens:
                raise PluginError(
                    f"--max-tokens {max_tokens} is less than the {int(num_tokens_vec[longest])} "
                    f"tokens of sentence {int(indices[longest])} of the split (a batch holds whole "
                    f"sentences); raise --max-tokens to at least {int(num_tokens_vec[longest])}, "
                    f"or leave longer sentences out with --max-source-positions and "
                    f"--max-target-positions {max_tokens}")
        return batch_by_size(indices, num_tokens_fn, num_tokens_vec, max_tokens, *args, **kwargs)

    return checked


def stops_in_one_line(command: str, note: str = ""):
    """Decorates a command's main: Ctrl-C or SIGTERM inside ends it with one line, "COMMAND:
    stopped by SIGNAL" (and ``note``, or the exception's own ``note``: what to do next), and the
    signal's exit status; the full traceback with FAIRSEQ_PLUGIN_TRACEBACK=1. The plugin's
    commands take ``command`` below; the demos' scripts this alone (their PluginErrors reach
    sys.excepthook's one line)."""
    def decorate(main):
        @functools.wraps(main)
        def wrapped(*args, **kwargs):
            previous = signal.signal(signal.SIGTERM, raise_stopped_in(os.getpid()))
            try:
                return main(*args, **kwargs)
            except (KeyboardInterrupt, Stopped) as stop:
                if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
                    raise
                signum = getattr(stop, "signum", signal.SIGINT)
                said = getattr(stop, "note", note)  # (the command may say more: prepare.py)
            finally:
                signal.signal(signal.SIGTERM, previous)
            end_by_signal(f"{command}: stopped by {STOP_NAMES[signum]}" + (
                f"; {said}" if said else ""), signum)
        return wrapped
    return decorate


def command(name: str, note: str = ""):
    """Decorates the main of each of the plugin's own commands (annotated-prepare, ...), naming
    the command once: a PluginError ends it with one line, ``NAME: error: <what is wrong and how
    to fix it>`` (exit status 1), and Ctrl-C or SIGTERM as ``stops_in_one_line`` says (with
    ``note``: what to do next). FAIRSEQ_PLUGIN_TRACEBACK=1 shows the traceback instead."""
    def decorate(main):
        @stops_in_one_line(name, note)
        @functools.wraps(main)
        def with_errors_in_one_line(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except PluginError as error:
                exit_in_one_line(name, error)
        return with_errors_in_one_line
    return decorate
