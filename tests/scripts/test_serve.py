"""`python -m hybrid_indexpool.scripts.serve`: transformers' OpenAI-compatible server on a tiny checkpoint, called with
the `openai` client; greedy completions equal `generate()`, streaming gives the same text."""

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from model_factory import tiny_model
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybrid_indexpool.scripts import serve
from hybrid_indexpool.tokenization import byte_level_tokenizer

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model and the byte-level tokenizer (with its chat template). Its generation config keeps the output to
    printable ASCII (and end of sequence), so any prefix of it decodes to a prefix of the text."""
    folder = tmp_path_factory.mktemp("serve") / "tiny"
    tokenizer = byte_level_tokenizer()
    model = tiny_model(0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    printable = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(chr(code))[0]) for code in range(32, 127)}
    model.generation_config.suppress_tokens = [
        token for token in range(len(tokenizer)) if token not in printable | {tokenizer.eos_token_id}]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def started_server(command: list[str], cwd=None):
    """The server `command` starts (its port among the arguments), as an `openai` client once `/health` answers;
    stopped at the end."""
    port = command[command.index("--port") + 1]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
                               cwd=cwd)
    url = f"http://localhost:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server did not start:\n{process.communicate()[0][-5000:]}")
        time.sleep(1)
    try:
        yield OpenAI(base_url=f"{url}/v1", api_key="not needed"), process
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def server(checkpoint):
    """The server as `python -m hybrid_indexpool.scripts.serve CHECKPOINT` starts it."""
    command = [sys.executable, "-m", "hybrid_indexpool.scripts.serve", checkpoint, "--port", str(free_port()),
               "--device", "cpu"]
    with started_server(command) as (client, _):
        yield client


def greedy_text(checkpoint: str, inputs: dict) -> tuple[str, int]:
    """What `generate()` gives for `inputs`, decoded, and how many tokens it generated."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokens = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)


def test_completions_are_generate_and_stream_the_same_text(server, checkpoint):
    prompt = "The quick brown fox jumps over the lazy dog, and then"
    expected, count = greedy_text(checkpoint, AutoTokenizer.from_pretrained(checkpoint)(prompt, return_tensors="pt"))
    assert count == NEW_TOKENS and len(expected) > 0

    completion = server.completions.create(model=checkpoint, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.usage.completion_tokens == NEW_TOKENS

    stream = server.completions.create(model=checkpoint, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                       stream=True)
    chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len([chunk for chunk in chunks if chunk]) > 1 and "".join(chunks) == expected


def test_chat_completions_use_the_chat_template_and_stream_the_same_text(server, checkpoint):
    messages = [{"role": "user", "content": "Say something about foxes."}]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected, _ = greedy_text(checkpoint, dict(inputs))

    reply = server.chat.completions.create(model=checkpoint, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected

    stream = server.chat.completions.create(model=checkpoint, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected


def test_the_file_form_serves_a_checkpoint_saved_by_save_pretrained(checkpoint, tmp_path):
    """`python scripts/serve.py CHECKPOINT`, from another folder: this file imports transformers before the package
    does, and the model's process (which transformers spawns) must still find the model's class."""
    script = Path(serve.__file__).resolve()  # the checkout's scripts/serve.py (or the installed copy's)
    prompt = "The quick brown fox"
    expected, _ = greedy_text(checkpoint, AutoTokenizer.from_pretrained(checkpoint)(prompt, return_tensors="pt"))
    command = [sys.executable, str(script), checkpoint, "--port", str(free_port()), "--device", "cpu"]
    with started_server(command, cwd=tmp_path) as (client, process):
        completion = client.completions.create(model=checkpoint, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        assert completion.choices[0].text == expected, process


@pytest.mark.parametrize("port, message", [
    ("-1", "error: --port is -1; give a port number from 1 to 65535 (default 8000).\n"),
    ("65536", "error: --port is 65536; give a port number from 1 to 65535 (default 8000).\n"),
])
def test_a_port_that_is_no_port_number_is_one_error_line(checkpoint, port, message, capsys):
    with pytest.raises(SystemExit) as stop:
        serve.main([checkpoint, "--port", port])
    assert stop.value.code == 2 and capsys.readouterr().err == message


def test_a_port_in_use_is_named_before_the_model_loads(checkpoint, capsys):
    with socket.create_server(("localhost", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as stop:
            serve.main([checkpoint, "--port", str(port)])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: cannot listen on localhost:{port} (Address already in use); choose a free --port (or a --host of "
        "this machine).\n")


@pytest.mark.parametrize("option, message", [
    ("--continuous-batching", "paged KV cache"),
    ("--compile", "static cache"),
])
def test_options_this_model_cannot_serve_with_are_refused(checkpoint, option, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main([checkpoint, option])
    assert exit_info.value.code == 2

    def compact(text):  # the message is printed wrapped in a box
        return "".join(text.replace("│", "").split())

    assert compact(message) in compact(capsys.readouterr().err)


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(
        tmp_path)
    with pytest.raises(SystemExit) as stop:
        serve.main([str(tmp_path)])
    printed = capsys.readouterr().err
    assert stop.value.code == 2 and "error: " in printed and "is a 'llama' model, not a HybridIndexPool one" in printed


def test_the_model_classes_become_known_to_transformers():
    import transformers

    serve.register_with_transformers()
    assert transformers.HybridIndexPoolForCausalLM is serve.hybrid_indexpool.HybridIndexPoolForCausalLM


def test_help_shows_every_option_name_whole_in_a_narrow_terminal(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as stop:
        serve.main(["--help"])
    printed = capsys.readouterr().out
    assert stop.value.code == 0
    for option in ("--continuous-batching / --no-continuous-batching", "--attn-implementation", "--compile"):
        assert option in printed
    assert "…" not in printed
