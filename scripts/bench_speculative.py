"""Speculative decoding benchmark, batch 1, side by side in one run (`hybrid_indexpool.speculative_benchmark`):

1. Verify cost: on a random model of Qwen3.8-Flash-Next's layer widths (`--layers`, 2048 hidden: a decode step
   reads its weights), the time of a forward of `k + 1` tokens over a cache of `--verify-context` tokens against a
   one-token step, per dtype of `--dtypes`; with `--baseline-python` (the interpreter of a checkout before a change,
   e.g. the main checkout's `.venv/bin/python`) the same measurement of that code runs in the same benchmark, right
   after, for a before/after table.
2. Drafting: plain greedy decoding against prompt lookup and MTP drafting of `k` = `--draft-lengths` tokens, on
   held-out text (the standard library's held-out files, byte-level tokens) at `--contexts` tokens and on a copying
   task (a passage of the prompt to repeat): tokens per second after the prefill, mean tokens accepted per verify
   forward, extra cache bytes over greedy's, whether the tokens equal greedy's. `--model` is a checkpoint (the
   byte-level model trained with an MTP head); without it a random tiny model runs (timings only: its drafts are
   not meant to be accepted). A method `generate()` refuses is reported with its error, not measured.

    python -m hybrid_indexpool.scripts.bench_speculative --quick
    python -m hybrid_indexpool.scripts.bench_speculative --baseline-python /work/main/.venv/bin/python \\
        --skip-drafting --json docs/results/bench_speculative_verify.json
"""

import argparse
import json
import os
import platform
import random
import subprocess
import sys

import torch

from hybrid_indexpool import speculative_benchmark
from hybrid_indexpool.benchmarking import MeasuringProcesses
from hybrid_indexpool.command_line import exit_with_error
from hybrid_indexpool.speculative_benchmark import compare_methods, copying_prompt, verify_cost

PRESETS = {
    "full": dict(layers=8, hidden_size=2048, verify_context=1024, widths="1,2,4,8", repeats=5, contexts="2048,8192",
                 new_tokens=64),
    "quick": dict(layers=4, verify_context=64, widths="1,2,4", repeats=2, contexts="64", new_tokens=8,
                  hidden_size=256),
}


def baseline_verify_cost(python: str, arguments: dict) -> dict:
    """`verify_cost(**arguments)` run by another interpreter (another checkout's package) on this module's file."""
    code = ("import json, runpy, sys; bench = runpy.run_path(sys.argv[1]); "
            "print(json.dumps(bench['verify_cost'](**json.loads(sys.argv[2]))))")
    result = subprocess.run([python, "-c", code, speculative_benchmark.__file__, json.dumps(arguments)],
                            capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if result.returncode:
        raise RuntimeError(f"the baseline measurement ({python}) failed:\n{result.stderr[-3000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return {key: {int(width): value for width, value in values.items()} for key, values in measured.items()}


def verify_rows(args) -> list[dict]:
    """Verify cost per dtype, this code and (with `--baseline-python`) the baseline's, one after the other."""
    processes = MeasuringProcesses(["torch", "hybrid_indexpool"])
    widths = [int(width) for width in args.widths.split(",")]
    rows = []
    for dtype in args.dtypes.split(","):
        arguments = dict(config_kwargs={"layers": args.layers, "hidden_size": args.hidden_size}, dtype=dtype,
                         context=args.verify_context, widths=widths, repeats=args.repeats, threads=args.threads)
        codes = [("this checkout", lambda: processes.run(verify_cost, *arguments.values(), label="verify_cost"))]
        if args.baseline_python:
            codes.append(("baseline", lambda: baseline_verify_cost(args.baseline_python, arguments)))
        for code, measure in codes:
            measured = measure()
            rows.append({"code": code, "dtype": dtype, "layers": args.layers, "hidden_size": args.hidden_size,
                         "context": args.verify_context, **measured})
    return rows


def load_model(args):
    """The checkpoint of `--model`, or a random tiny byte-level model; in `--drafting-dtype`."""
    from hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolForCausalLM

    dtype = getattr(torch, args.drafting_dtype)
    if args.model:
        return HybridIndexPoolForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    torch.manual_seed(args.seed)
    config = HybridIndexPoolConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, index_n_heads=2,
                                   index_head_dim=16, index_topk=64, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                   num_mtp_layers=1, pad_token_id=0, eos_token_id=None)
    return HybridIndexPoolForCausalLM(config).eval().to(dtype)


def drafting_rows(args) -> list[dict]:
    """Every draft method on held-out text at each context and on the copying task."""
    from hybrid_indexpool.retrieval_task import stdlib_texts, text_window
    from hybrid_indexpool.tokenization import byte_level_tokenizer

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model = load_model(args)
    tokenizer = byte_level_tokenizer()
    _, held_out, _, _ = stdlib_texts()
    rng = random.Random(args.seed)
    draft_lengths = [int(k) for k in args.draft_lengths.split(",")]
    tasks = [(f"held-out text {context}", text_window(held_out, context, rng)) for context in
             (int(c) for c in args.contexts.split(","))]
    rows = []
    for task, text in tasks:
        prompt = torch.tensor([tokenizer(text)["input_ids"]])
        rows += [{"task": task, **row} for row in compare_methods(model, prompt, args.new_tokens, draft_lengths,
                                                                  args.prompt_lookup_tokens)]
    passage = torch.tensor(tokenizer(text_window(held_out, args.copy_length, rng))["input_ids"])
    marker = torch.tensor(tokenizer("\n# again:\n")["input_ids"])
    prompt = copying_prompt(passage, marker)
    rows += [{"task": "copying", **row} for row in compare_methods(
        model, prompt, min(args.new_tokens, len(passage) - 1), draft_lengths, args.prompt_lookup_tokens)]
    return rows


def format_table(report: dict) -> str:
    lines = []
    if report.get("verify"):
        widths = sorted(report["verify"][0]["seconds"])
        first = report["verify"][0]
        lines.append(f"Verify forward over a {first['context']}-token cache, {first['layers']} layers of hidden "
                     f"{first['hidden_size']}: ms (ratio to 1 token)")
        lines.append(f"{'code':<14} {'dtype':<9} " + " ".join(f"{f'{w} tokens':>16}" for w in widths))
        for row in report["verify"]:
            cells = " ".join(f"{row['seconds'][w] * 1e3:>8.1f} ({row['ratio'][w]:.2f}x)" for w in widths)
            lines.append(f"{row['code']:<14} {row['dtype']:<9} {cells}")
    if report.get("drafting"):
        lines.append("")
        lines.append(f"{'task':<22} {'method':<14} {'k':>2} {'tok/s':>8} {'speedup':>8} {'accepted':>9} "
                     f"{'extra cache B':>14} {'= greedy':>9}")
        for row in report["drafting"]:
            head = f"{row['task']:<22} {row['method']:<14} {row['draft_tokens']:>2}"
            if "error" in row:
                lines.append(f"{head}  not measured: {row['error'][:90]}")
                continue
            lines.append(f"{head} {row['tokens_per_second']:>8.2f} {row['speedup']:>7.2f}x "
                         f"{row['mean_accepted_per_verify']:>9.2f} {row.get('extra_cache_bytes', 0):>14} "
                         f"{str(row.get('same_tokens_as_greedy', '')):>9}")
    return "\n".join(lines)


def machine(args) -> dict:
    import transformers

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "threads": args.threads or torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "load_average_at_start": os.getloadavg()}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke test)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="dtypes of the verify-cost model")
    parser.add_argument("--layers", type=int, help="layers of the verify-cost model (a multiple of 4; default 8)")
    parser.add_argument("--hidden-size", type=int, help="hidden size of the verify-cost model (default 2048)")
    parser.add_argument("--verify-context", type=int, help="cached tokens before the verify forwards (default 1024)")
    parser.add_argument("--widths", help="tokens per verify forward, comma-separated, 1 included (default 1,2,4,8)")
    parser.add_argument("--repeats", type=int, help="timed rounds (median; default 5)")
    parser.add_argument("--baseline-python", help="interpreter of a checkout to time as 'baseline' in the same run")
    parser.add_argument("--skip-verify", action="store_true")
    parser.add_argument("--skip-drafting", action="store_true")
    parser.add_argument("--model", help="checkpoint to draft with (default: a random tiny byte-level model)")
    parser.add_argument("--drafting-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--contexts", help="held-out text prompt lengths, comma-separated (default 2048,8192)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per run (default 64)")
    parser.add_argument("--draft-lengths", default="1,2,3", help="MTP draft lengths k")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=5)
    parser.add_argument("--copy-length", type=int, default=200, help="characters of the passage to copy")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    for name, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.layers % 4:
        exit_with_error(f"--layers is {args.layers}; give a multiple of 4 (three Gated DeltaNet layers per "
                        "IndexPool layer).")
    if "1" not in args.widths.split(","):
        exit_with_error(f"--widths is {args.widths}; include 1, the one-token step the others are compared with.")
    if args.baseline_python and not os.access(args.baseline_python, os.X_OK):
        exit_with_error(f"--baseline-python {args.baseline_python} is not an executable; give a Python interpreter.")
    return args


def run(args) -> dict:
    """The whole benchmark as a report (what `--json` writes)."""
    report = {"machine": machine(args), "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    if not args.skip_verify:
        report["verify"] = verify_rows(args)
    if not args.skip_drafting:
        report["drafting"] = drafting_rows(args)
    return report


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    report = run(args)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
