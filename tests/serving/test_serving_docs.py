"""The serving blocks of the README and of `docs/serving.md` (those marked `<!-- vllm phase:
tests/serving/test_serving_docs.py -->`) run as written, in CI's vLLM phase (marker `vllm`), on the outputs of the
README's round trip: a command that starts a server (`--port N`) is left running once it answers `/health`, every
other command must succeed, and each server answers a completion before it is stopped.

The block runs in a scratch folder holding the round trip's outputs and a link `.venv-vllm` to the vLLM environment
running this test; `python` is the development environment's (`HYBRID_INDEXPOOL_REFERENCE_PYTHON`), as the README
assumes. Only the port numbers are changed, to free ones (other test sessions may hold the written ones).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from doc_blocks import ROOT, examples
from vllm_reference import REFERENCE_PYTHON

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

RUNNER = "tests/serving/test_serving_docs.py"
PAGES = [ROOT / "README.md", ROOT / "docs" / "serving.md"]
BLOCKS = [example for page in PAGES for example in examples(page) if example.vllm_runner == RUNNER]
SERVER_START_S = 600  # a vLLM engine starts in about a minute on 2 idle cores, several on a loaded machine
PORT = re.compile(r"(--port\s+|localhost:)(\d+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def commands(code: str) -> list[str]:
    """The block's commands: continuation lines joined, blank lines and comment-only lines left out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def block_environment() -> dict[str, str]:
    development_bin = str(Path(REFERENCE_PYTHON).parent)
    return {**os.environ, "PATH": f"{development_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory) -> Path:
    """A scratch folder after the README's round trip (the block that starts with `make_tiny_source`), with the vLLM
    environment linked in as `.venv-vllm`."""
    folder = tmp_path_factory.mktemp("round-trip")
    (block,) = [example for example in examples(ROOT / "README.md")
                if "make_tiny_source" in example.code and example.not_run is None and example.language == "shell"]
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=folder, env=block_environment(),
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    (folder / ".venv-vllm").symlink_to(Path(sys.prefix))
    return folder


def wait_until_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server stopped:\n{log.read_text()[-6000:]}"
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5)
            return
        except OSError:
            time.sleep(2)
    pytest.fail(f"no answer from {url}/health in {SERVER_START_S} s:\n{log.read_text()[-6000:]}")


def complete(url: str) -> dict:
    model = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=60).read())["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=300).read())


def test_the_readme_and_the_serving_guide_have_blocks_for_this_phase():
    assert {block.page.name for block in BLOCKS} == {"README.md", "serving.md"}
    assert any("vllm.entrypoints.openai.api_server" in block.code for block in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_serving_block_runs_as_written(block, round_trip, tmp_path):
    ports = {port: free_port() for port in sorted({int(port) for _, port in PORT.findall(block.code)})}
    servers = []
    try:
        for number, command in enumerate(commands(block.code)):
            command = PORT.sub(lambda match: f"{match.group(1)}{ports[int(match.group(2))]}", command)
            starts_server = re.search(r"--port\s+(\d+)", command)
            if starts_server is None:
                result = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=round_trip,
                                        env=block_environment(), capture_output=True, text=True, timeout=600)
                assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
                continue
            log = tmp_path / f"server-{number}.log"
            with log.open("w") as output:
                process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=round_trip, env=block_environment(),
                                           stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
            url = f"http://127.0.0.1:{starts_server.group(1)}"
            servers.append((process, url, log))
            wait_until_healthy(url, process, log)
        assert servers, "the block starts no server"
        for process, url, log in servers:
            reply = complete(url)
            assert reply["usage"]["completion_tokens"] == 8, (url, reply)
    finally:
        for process, _, _ in servers:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
