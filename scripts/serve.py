"""Serve a HybridIndexPool checkpoint with transformers' own OpenAI-compatible server (`transformers serve`).

    python -m hybrid_indexpool.scripts.serve CHECKPOINT [--port 8000] [--device cuda:0] [`transformers serve` options]

The endpoints are transformers' (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`; streaming
included). `transformers serve` finds a checkpoint's class with `getattr(transformers, config.architectures[0])`, which
does not know remote-code architectures; this script makes the HybridIndexPool classes known to transformers (the Auto
classes, and that lookup) and starts the server pinned to CHECKPOINT. Requests are generated one at a time with
`generate()` (`--continuous-batching` is refused: its paged KV cache cannot hold this model's state).
"""

import inspect
import os
import socket
import sys
from typing import Annotated

import hybrid_indexpool
from hybrid_indexpool.command_line import exit_with_error
from hybrid_indexpool.configuration import HybridIndexPoolConfig

SERVE_HELP = """Serve a HybridIndexPool checkpoint with transformers' own OpenAI-compatible server
(`transformers serve`: /v1/completions, /v1/chat/completions, streaming); every option is transformers'.
--continuous-batching and --compile are refused (transformers' paged and static caches cannot hold this model's
state)."""

MODEL_CLASSES = (
    hybrid_indexpool.HybridIndexPoolModel,
    hybrid_indexpool.HybridIndexPoolForCausalLM,
    hybrid_indexpool.HybridIndexPoolForSequenceClassification,
)


def register_with_transformers() -> None:
    """Make `getattr(transformers, "HybridIndexPoolForCausalLM")` (and the other classes) work, as for the
    architectures transformers ships; importing `hybrid_indexpool` already registered them with the Auto classes.

    The first import of `transformers.processing_utils` executes transformers' `__init__` again and puts the new
    module object in `sys.modules`: a `transformers` bound before that (this file's own import, when it runs as a file
    and imports transformers before the package does) is a stale object the server never looks at. So the classes go
    on the module transformers' server will read, fetched once that import has happened."""
    import transformers.processing_utils  # noqa: F401  (the import that replaces the module, if not done yet)

    module = sys.modules["transformers"]
    for model_class in MODEL_CLASSES:
        setattr(module, model_class.__name__, model_class)


# transformers' server loads the model (and serves, with --api-server-count) in processes it spawns, where
# multiprocessing imports this script as `__mp_main__` and runs nothing else of it: the classes must be known there.
if __name__ == "__mp_main__":
    register_with_transformers()


def check_address(host: str, port: int) -> None:
    """Refuse, before the server starts, a `--port` that is no port number, or an address the server could not listen
    on (the port taken, the host not this machine's): the server itself would fail after loading, with a socket error
    that names neither."""
    if not 1 <= port <= 65535:
        exit_with_error(f"--port is {port}; give a port number from 1 to 65535 (default 8000).")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        exit_with_error(f"cannot listen on {host}:{port} ({reason}); choose a free --port (or a --host of this "
                        "machine).")


def check_checkpoint(checkpoint: str, trust_remote_code: bool = False) -> None:
    """Refuse, before the server starts, a checkpoint that is not a HybridIndexPool model."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        exit_with_error(f"cannot read a model config from {checkpoint!r}: {error}")
    if config.model_type != HybridIndexPoolConfig.model_type:
        exit_with_error(f"{checkpoint!r} is a {config.model_type!r} model, not a HybridIndexPool one; serve it with "
                        "`transformers serve` itself.")


def _serve_command():
    """transformers' `Serve` command with the model argument required (the checkpoint) and the options of this model
    checked before the server starts; every other option is transformers' own."""
    import typer
    from transformers.cli.serve import Serve

    def serve(**options):
        if options["continuous_batching"]:
            raise typer.BadParameter(
                "continuous batching keeps keys and values in transformers' paged KV cache, which cannot hold "
                "HybridIndexPool's state (Gated DeltaNet recurrent states, pooled indexer keys, per-row lengths). "
                "Serve without --continuous-batching: requests then run one at a time through generate().",
                param_hint="--continuous-batching",
            )
        if options["compile"]:
            raise typer.BadParameter(
                "--compile asks generate() for transformers' static cache, which cannot hold HybridIndexPool's "
                "state. Leave it out: this model's cache is already reserved with fixed shapes, and generate() "
                "compiles the decode step on GPUs by itself.",
                param_hint="--compile",
            )
        check_address(options["host"], options["port"])
        check_checkpoint(options["force_model"], options["trust_remote_code"])
        register_with_transformers()
        Serve(**options)

    signature = inspect.signature(Serve)
    parameters = list(signature.parameters.values())
    parameters[0] = parameters[0].replace(
        annotation=Annotated[str, typer.Argument(metavar="CHECKPOINT",
                                                 help="HybridIndexPool checkpoint folder or Hub id to serve.")],
        default=inspect.Parameter.empty,
    )
    serve.__signature__ = signature.replace(parameters=parameters)
    serve.__doc__ = " ".join(SERVE_HELP.split())
    return serve


def main(argv: list[str] | None = None) -> None:
    import typer
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        exit_with_error("the server needs FastAPI, Uvicorn and openai: in a checkout of this project, "
                        "pip install -e '.[serve]'.")
    # Plain help (click's): rich's table cuts the long option names of transformers' serve to fit the terminal.
    app = typer.Typer(add_completion=False, rich_markup_mode=None)
    app.command()(_serve_command())
    app(args=sys.argv[1:] if argv is None else argv, prog_name="python -m hybrid_indexpool.scripts.serve")


if __name__ == "__main__":
    main()
