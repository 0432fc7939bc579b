"""Helpers the benchmark scripts share: each measurement in a fresh process that fails loudly, wall-time medians,
and the machine's memory bandwidth (the roofline's denominator).

A fresh process per measurement keeps one run's allocations, compiled code and thread pools out of the next. The
child sends back its result or its formatted traceback, never an exception object: an exception that cannot be
unpickled in the parent (transformers' strict config errors, for one) kills `multiprocessing.Pool`'s result thread
and leaves the parent waiting forever. The parent waits on the pipe and on the process together, so a child that
dies without answering (`os._exit`, a signal, the out-of-memory killer) is reported at once.
"""

import multiprocessing
import signal
import statistics
import time
import traceback
from multiprocessing.connection import wait

import torch


class MeasurementFailed(RuntimeError):
    """A measuring process raised, could not send its result, or died; the message says which and why."""


def _child(connection, function, args) -> None:
    try:
        result = function(*args)
        connection.send(("result", result))
    except BaseException:  # the parent reports it; nothing escapes the child as an object
        connection.send(("error", traceback.format_exc()))
    finally:
        connection.close()


def _death(exitcode: int) -> str:
    """How a process that sent nothing ended, from its exit code (negative: the signal that killed it)."""
    if exitcode == -signal.SIGKILL:
        return "was killed by SIGKILL (out of memory, if the kernel's out-of-memory killer sent it)"
    if exitcode < 0:
        return f"was killed by signal {-exitcode} ({signal.strsignal(-exitcode)})"
    return f"exited with status {exitcode} without a result"


class MeasuringProcesses:
    """`run(function, *args)` calls `function(*args)` in a new process forked from a fork server that has imported
    `preload` once, and returns its result or raises `MeasurementFailed` with the child's traceback or cause of
    death, naming the run by `label` (default: the function's name). `function`, its arguments and its result must
    pickle."""

    def __init__(self, preload: list[str]):
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(preload)

    def run(self, function, *args, label: str | None = None):
        name = label or getattr(function, "__qualname__", repr(function))
        receiver, sender = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_child, args=(sender, function, args), daemon=True)
        process.start()
        sender.close()  # the child holds the only writer: its death ends the pipe
        try:
            # The process's end as well as the pipe's: a grandchild that inherited the writer keeps the pipe open.
            wait([receiver, process.sentinel])
            try:
                kind, payload = receiver.recv() if receiver.poll() else (None, None)
            except EOFError:
                kind = None
            process.join()
            if kind is None:
                raise MeasurementFailed(f"{name} {_death(process.exitcode)}")
        finally:
            receiver.close()
            if process.is_alive():  # the parent was interrupted
                process.kill()
                process.join()
        if kind == "error":
            raise MeasurementFailed(f"{name} raised in its measuring process:\n{payload}")
        return payload


def median_seconds(function, repeats: int = 5, clock=time.perf_counter) -> float:
    """Median time of `repeats` calls of `function` on `clock` (wall time; `time.process_time` for the CPU time the
    process used, which a loaded machine's waits for a core do not count)."""
    samples = []
    for _ in range(repeats):
        start = clock()
        function()
        samples.append(clock() - start)
    return statistics.median(samples)


def copy_bandwidth(elements: int = 1 << 27, clock=time.perf_counter) -> float:
    """Bytes read plus written per second by a 512 MiB in-memory copy with the current thread count, median of five
    (seconds on `clock`, as `median_seconds`)."""
    source = torch.ones(elements)
    target = torch.empty_like(source)
    return 2 * source.numel() * source.element_size() / median_seconds(lambda: target.copy_(source), clock=clock)


def read_bandwidth(elements: int = 1 << 27) -> float:
    """Bytes per second of a sum over 512 MiB (reads only, as most of a decode step's bytes), median of five."""
    source = torch.ones(elements)
    return source.numel() * source.element_size() / median_seconds(source.sum)
