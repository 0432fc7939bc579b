"""One guard for the tests that prove a forward reads nothing back from the device (so that it can be captured in a
CUDA graph): `HostSyncGuard`."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_indexpool.serving.synthetic_step import OperationCounter


class HostSyncGuard:
    """Raises on anything that reads a tensor's value on the host or sizes a tensor by its values: `.item()`,
    `.tolist()`, `.cpu()`, `.numpy()`, `bool`/`int`/`float`/index of a tensor and `torch.nonzero` (patched), and the
    operators these and boolean-mask indexing reach (seen by a dispatch mode). Records each operator run with its
    output shapes in `trace`.

    A Triton launch runs with the guard lifted: on a GPU it only enqueues the kernel, while the interpreter reads the
    tensors on the host to emulate it. `look_into` maps a custom operator's name to its Python implementation, run
    under the guard instead of as one operator."""

    PATCHED = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")
    SYNC_OPS = OperationCounter.SYNCING

    def __init__(self, look_into: dict | None = None):
        self.look_into = look_into or {}

    def __enter__(self):
        from hybrid_indexpool.kernels import launch

        guard, self.trace = self, []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in guard.SYNC_OPS:
                    raise AssertionError(f"host sync: aten.{name}")
                if name == "index" and any(index is not None and index.dtype == torch.bool for index in args[1]):
                    raise AssertionError("boolean-mask indexing")
                if name in guard.look_into:
                    with self:
                        result = guard.look_into[name](*args, **(kwargs or {}))
                else:
                    result = func(*args, **(kwargs or {}))
                outputs = result if isinstance(result, (tuple, list)) else [result]
                guard.trace.append((name, [tuple(t.shape) for t in outputs if isinstance(t, torch.Tensor)]))
                return result

        self.originals = {name: getattr(torch.Tensor, name) for name in self.PATCHED}
        self.original_nonzero, self.original_run = torch.nonzero, launch.Launch.run
        self.mode = Mode()

        def lifted_run(launch_self):
            self._lift()
            try:
                return self.original_run(launch_self)
            finally:
                self._impose()

        launch.Launch.run = lifted_run
        self._impose()
        return self

    def _impose(self):
        for name in self.PATCHED:
            setattr(torch.Tensor, name, self._raiser(name))
        torch.nonzero = self._raiser("torch.nonzero")
        self.mode.__enter__()

    def _lift(self):
        self.mode.__exit__(None, None, None)
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = self.original_nonzero

    @staticmethod
    def _raiser(name):
        def raise_sync(*args, **kwargs):
            raise AssertionError(f"host sync: {name}")
        return raise_sync

    def __exit__(self, *exc):
        from hybrid_indexpool.kernels import launch

        self._lift()
        launch.Launch.run = self.original_run
        return False
