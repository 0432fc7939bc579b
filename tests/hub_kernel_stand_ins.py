"""Stand-in kernel packages (`causal_conv1d`, `fla`) on CPU tensors, for the tests of the dispatch to them."""


def run_stand_in_on_cpu(package: str) -> None:
    """Let transformers' hub-kernel helper call `package` on CPU tensors: from transformers 5.25 it sends inputs on a
    device the real package does not support to the PyTorch path. Must run before the kernel module that wraps the
    package is imported (the helper reads the devices when it wraps a function)."""
    from transformers.integrations import hub_kernels

    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if devices is not None:
        devices[package] = (*devices.get(package, ()), "cpu")
