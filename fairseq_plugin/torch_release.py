"""The installed torch's (major, minor) release, for the few places that depend on it."""

import re

import torch


def release(version: str) -> tuple:
    """(major, minor) of a torch version string. A pre-release such as "2.6.0a0+git..." (NVIDIA's
    containers, source builds) counts as 2.6, which it implements; a PEP 440 comparison (what
    ``torch.__version__ >= (2, 6)`` does) would put it before 2.6."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


TORCH_RELEASE = release(torch.__version__)


def compiling() -> bool:
    """Whether torch.compile is tracing the code that asks (torch.compiler.is_compiling since
    torch 2.3, torch._dynamo.is_compiling before)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    if is_compiling is None:
        from torch import _dynamo

        is_compiling = _dynamo.is_compiling
    return is_compiling()
