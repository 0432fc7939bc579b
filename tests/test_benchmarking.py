import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from hybrid_indexpool.benchmarking import MeasurementFailed, MeasuringProcesses

# Each child imports this module, and through it the package: preloaded in the fork server, once.
PROCESSES = MeasuringProcesses(["hybrid_indexpool"])


class TwoArgumentError(Exception):
    """Like transformers' strict config errors: pickles, but cannot be rebuilt from its message alone."""

    def __init__(self, validator, cause):
        super().__init__(f"{validator}: {cause}")


def raise_unpicklable():
    raise TwoArgumentError("validate_architecture", "rotary_dim=256 exceeds indexer_head_dim=128")


def exit_abruptly():
    os._exit(3)


def kill_self(signal_number=signal.SIGKILL):
    os.kill(os.getpid(), signal_number)


def terminate_self():
    kill_self(signal.SIGTERM)


def return_unpicklable():
    return lambda: None


def test_the_error_cannot_be_unpickled():
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(TwoArgumentError("validate_architecture", "cause")))


def test_result_comes_back():
    assert PROCESSES.run(divmod, 7, 2) == (3, 1)


@pytest.mark.parametrize("function, message", [
    (raise_unpicklable, "TwoArgumentError: validate_architecture: rotary_dim=256 exceeds indexer_head_dim=128"),
    (return_unpicklable, "Can't pickle"),
    (exit_abruptly, "exited with status 3 without a result"),
    (kill_self, "was killed by SIGKILL"),
    (terminate_self, "was killed by signal 15 (Terminated)"),
])
def test_a_failing_or_dying_child_is_reported_quickly(function, message):
    start = time.perf_counter()
    with pytest.raises(MeasurementFailed, match="run 1") as failure:
        PROCESSES.run(function, label="run 1")
    assert message in str(failure.value)
    assert time.perf_counter() - start < 30


def test_bench_decode_exits_non_zero_with_the_measurement_error():
    # A reference config that transformers rejects (rotary width 64 beyond an indexer head of 32) raises a strict
    # config error inside a worker: the benchmark must report it and exit, not hang waiting for the worker.
    command = [sys.executable, "-m", "hybrid_indexpool.scripts.bench_decode", "--quick", "--contexts", "300",
               "--settings", "qwen4_exp", "--head-dim", "64", "--index-head-dim", "32", "--partial-rotary-factor", "1"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode != 0
    assert finished.returncode == 2
    assert "error: qwen4_exp at 300 tokens raised in its measuring process" in finished.stderr
    assert "must fit the QSA index head" in finished.stderr
