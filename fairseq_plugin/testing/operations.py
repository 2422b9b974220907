"""Counting the tensor operations of each beam-search step: those that launch work on the device,
and those that read a value back to the host. On a GPU each launch costs the host a few
microseconds whatever its size, and each read waits until the device has finished everything
queued before it; when steps are small, these counts rather than the arithmetic set the pace.

Counted with a ``TorchDispatchMode``, so they can be taken on the CPU: the model runs the same
operations on every device (fused attention is one operation whichever kernel implements it).
"""

import contextlib
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operations that return a value to the host (bool(t), int(t), t.item(), torch.equal, nonzero)
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
              torch.ops.aten.is_nonzero.default, torch.ops.aten.nonzero.default}
# a new shape over the same storage, which launches nothing, though not marked as a view
METADATA_ONLY = {torch.ops.aten._unsafe_view.default}

# the calls beam search makes into a fairseq model at every step
STEP_CALLS = (("decoder", "forward"), ("decoder", "reorder_incremental_state_scripting"),
              ("encoder", "reorder_encoder_out"))


class OperationCounter(TorchDispatchMode):
    """Counts launches and host reads while active. A tensor made from Python values
    (``torch.tensor(3)``) lives on the host, also in GPU runs: reading it is not counted (counters
    given the same ``on_host`` list know those made under each other). ``Tensor.tolist`` reads
    without dispatching an operation: it is counted by wrapping it."""

    def __init__(self, on_host: Optional[List[torch.Tensor]] = None):
        super().__init__()
        self.launches = 0
        self.reads = 0
        self._on_host = [] if on_host is None else on_host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(python values)
            self._on_host.append(out)
        elif func in HOST_READS:
            self.reads += not any(args[0] is t for t in self._on_host)
        elif not func.is_view and func not in METADATA_ONLY:
            self.launches += 1
        return out

    def __enter__(self):
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.reads += 1
            return tolist(tensor)
        self._tolist = tolist
        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


@contextlib.contextmanager
def around_calls(methods, around):
    """While inside, each call of the methods ``[(object, method name), ...]`` runs inside the
    context manager ``around(method name)``."""
    wrapped_objects = []
    for obj, name in methods:
        method = getattr(obj, name)

        def wrapped(*args, _method=method, _name=name, **kwargs):
            with around(_name):
                return _method(*args, **kwargs)
        setattr(obj, name, wrapped)  # an instance attribute, over the class's method
        wrapped_objects.append((obj, name))
    try:
        yield
    finally:
        for obj, name in wrapped_objects:
            delattr(obj, name)


def around_step_calls(model, around):
    """While inside, each of the model's per-step calls (``STEP_CALLS``) runs inside the context
    manager ``around(call name)``."""
    return around_calls([(getattr(model, part), name) for part, name in STEP_CALLS], around)


@contextlib.contextmanager
def counting_step_calls(model):
    """While inside, each of the model's per-step calls (``STEP_CALLS``) is counted on its own:
    yields {call name: [(launches, reads) of each call]}."""
    counts: Dict[str, list] = {name: [] for _, name in STEP_CALLS}
    on_host: List[torch.Tensor] = []  # made from Python values in one call, read in another

    @contextlib.contextmanager
    def counted(name):
        with OperationCounter(on_host) as counter:
            yield
        counts[name].append((counter.launches, counter.reads))

    with around_step_calls(model, counted):
        yield counts


def per_step(counts: Dict[str, list]) -> Dict[str, float]:
    """Launches and reads per decoder step, over every per-step call."""
    steps = len(counts["forward"])
    calls = [c for name in counts for c in counts[name]]
    return {"launches": sum(c[0] for c in calls) / steps, "reads": sum(c[1] for c in calls) / steps}
