"""Speculative decoding benchmark, batch 1, side by side in one run (`hybrid_indexpool.speculative_benchmark`):

1. Verify cost: on a random model of Qwen3.8-Flash-Next's layer widths (`--layers`, 2048 hidden: a decode step
   reads its weights), the time of a forward of `k + 1` tokens over a cache of `--verify-context` tokens against a
   one-token step, per dtype of `--dtypes`; with `--baseline-python` (the interpreter of a checkout before a change,
   e.g. the main checkout's `.venv/bin/python`) the same measurement of that code runs in the same benchmark, right
   after, for a before/after table.
2. Random head: on that model with one random MTP layer (whose drafts the model never keeps), plain greedy against
   MTP drafting of `k` = `--draft-lengths` tokens: time per token and the time of a drafting round.
3. Drafting: plain greedy decoding against prompt lookup and MTP drafting of each `k`, on held-out text (the standard
   library's held-out files, byte-level tokens) at `--contexts` tokens and on a copying task (a passage of the prompt
   to repeat; `--copy-passages` held-out passages, each its own prompt, summarised by the median and range over
   them), per dtype of `--drafting-dtypes`: tokens per second after the prefill, tokens per verify forward,
   extra cache bytes, whether the tokens equal greedy's. `--model` is a checkpoint with an MTP head, `--train FOLDER`
   trains one first (`speculative_benchmark.train_drafting_model`); without either a random tiny model runs (timings
   only). A method `generate()` refuses is reported as not available, with its error.
4. Derived (not measured): the speedup of MTP drafting at the widths of 1-2, from 3's acceptance and 1-2's times.

    python -m hybrid_indexpool.scripts.bench_speculative --quick
    python -m hybrid_indexpool.scripts.bench_speculative --train /tmp/drafting-model \\
        --json docs/results/bench_speculative.json
"""

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import torch

from hybrid_indexpool import speculative_benchmark
from hybrid_indexpool.benchmarking import MeasuringProcesses
from hybrid_indexpool.command_line import exit_with_error
from hybrid_indexpool.speculative_benchmark import (
    compare_methods,
    copying_prompt,
    draft_cost,
    train_drafting_model,
    verify_cost,
)

PRESETS = {
    "full": dict(layers=8, hidden_size=2048, verify_context=1024, widths="1,2,3,4,8", repeats=5, contexts="2048,8192",
                 new_tokens=64, draft_new_tokens=16, generation_repeats=2),
    "quick": dict(layers=4, verify_context=64, widths="1,2,4", repeats=2, contexts="64", new_tokens=8,
                  hidden_size=256, draft_new_tokens=4, generation_repeats=1),
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


def weight_bound_draft_rows(args) -> list[dict]:
    """Plain greedy against MTP drafting with a random head, per dtype, on the random model of the verify widths."""
    processes = MeasuringProcesses(["torch", "hybrid_indexpool"])
    rows = []
    for dtype in args.dtypes.split(","):
        measured = processes.run(
            draft_cost, {"layers": args.layers, "hidden_size": args.hidden_size}, dtype, args.verify_context,
            [int(k) for k in args.draft_lengths.split(",")], args.draft_new_tokens, args.generation_repeats,
            args.threads, args.seed, label="draft_cost")
        rows += [{"dtype": dtype, "layers": args.layers, "hidden_size": args.hidden_size, **row} for row in measured]
    return rows


def load_model(args, dtype: str):
    """The checkpoint of `--model`, or a random tiny byte-level model with one MTP layer; in `dtype`."""
    from hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolForCausalLM

    if args.model:
        return HybridIndexPoolForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype)).eval()
    torch.manual_seed(args.seed)
    config = HybridIndexPoolConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, index_n_heads=2,
                                   index_head_dim=16, index_topk=64, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                   num_mtp_layers=1, pad_token_id=0, eos_token_id=None)
    return HybridIndexPoolForCausalLM(config).eval().to(getattr(torch, dtype))


def drafting_rows(args) -> list[dict]:
    """Every draft method on held-out text at each context and on the copying task, per dtype of
    `--drafting-dtypes`."""
    from hybrid_indexpool.retrieval_task import stdlib_texts, text_window
    from hybrid_indexpool.tokenization import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    _, held_out, _, _ = stdlib_texts()
    rng = random.Random(args.seed)
    draft_lengths = [int(k) for k in args.draft_lengths.split(",")]
    # (task, prompt, tokens to generate, passage number of the copying task)
    tasks = [(f"held-out text {context}", torch.tensor([tokenizer(text_window(held_out, context, rng))["input_ids"]]),
              args.new_tokens, None) for context in (int(c) for c in args.contexts.split(","))]
    marker = torch.tensor(tokenizer("\n# again:\n")["input_ids"])
    for passage_index in range(args.copy_passages):
        passage = torch.tensor(tokenizer(text_window(held_out, args.copy_length, rng))["input_ids"])
        tasks.append(("copying", copying_prompt(passage, marker), min(args.new_tokens, len(passage) - 1),
                      passage_index))
    rows = []
    for dtype in args.drafting_dtypes.split(","):
        model = load_model(args, dtype)
        for task, prompt, new_tokens, passage_index in tasks:
            which = {} if passage_index is None else {"passage": passage_index}
            rows += [{"task": task, "dtype": dtype, **which, **row} for row in compare_methods(
                model, prompt, new_tokens, draft_lengths, args.prompt_lookup_tokens, repeats=args.generation_repeats,
                clock=time.thread_time if args.clock == "cpu" else time.perf_counter)]
    return rows


def tokens_per_verify(row: dict) -> float:
    """Tokens each verify forward yields: `1 +` the drafts kept (the MTP drafter's own count where it has one)."""
    if "accepted_drafts_per_verify" in row:
        return 1 + row["accepted_drafts_per_verify"]
    return row["mean_accepted_per_verify"]


def copying_summary(rows: list[dict]) -> list[dict]:
    """The copying task over its passages, per dtype and draft method: the median and the range (lowest, highest) of
    the speedup over greedy and of the tokens per verify forward, and whether every passage gave greedy's tokens."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["task"] == "copying" and "error" not in row:
            groups.setdefault((row["dtype"], row["method"], row["draft_tokens"]), []).append(row)
    summary = []
    for (dtype, method, draft_tokens), group in groups.items():
        speedups = [row["speedup"] for row in group]
        per_verify = [tokens_per_verify(row) for row in group]
        summary.append({
            "dtype": dtype, "method": method, "draft_tokens": draft_tokens, "passages": len(group),
            "speedup_median": statistics.median(speedups), "speedup_range": [min(speedups), max(speedups)],
            "tokens_per_verify_median": statistics.median(per_verify),
            "tokens_per_verify_range": [min(per_verify), max(per_verify)],
            "tokens_per_second_median": statistics.median(row["tokens_per_second"] for row in group),
            "same_tokens_as_greedy": all(row.get("same_tokens_as_greedy", True) for row in group),
        })
    return summary


def derived_speedups(report: dict) -> list[dict]:
    """DERIVED, not measured: the speedup MTP drafting of `k` tokens would give at the verify widths, from the trained
    head's acceptance (tokens per verify forward `1 + accepted drafts`, on the longest held-out context, drafting
    dtype as close as there is) and the measured times there: `(1 + accepted) * t_1 / (t_verify(k + 1) + t_draft(k))`,
    with `t_1` a one-token step, `t_verify` the verify forward and `t_draft` a drafting round of the random head."""
    verify = {row["dtype"]: row for row in report.get("verify", []) if row["code"] == "this checkout"}
    drafts = {(row["dtype"], row["draft_tokens"]): row for row in report.get("weight_bound_drafting", [])
              if row["method"] == "mtp" and "draft_round_seconds" in row}
    held_out = [row for row in report.get("drafting", []) if row["task"].startswith("held-out") and
                row["method"] == "mtp" and "accepted_drafts_per_verify" in row]
    rows = []
    for dtype, timing in verify.items():
        for k in sorted({row["draft_tokens"] for row in held_out}):
            if (dtype, k) not in drafts or k + 1 not in timing["seconds"]:
                continue
            candidates = [row for row in held_out if row["draft_tokens"] == k]
            same_dtype = [row for row in candidates if row["dtype"] == dtype] or candidates
            acceptance = max(same_dtype, key=lambda row: row["context"])
            tokens_per_verify = 1 + acceptance["accepted_drafts_per_verify"]
            round_seconds = timing["seconds"][k + 1] + drafts[(dtype, k)]["draft_round_seconds"]
            rows.append({"dtype": dtype, "draft_tokens": k, "tokens_per_verify": tokens_per_verify,
                         "acceptance_from": f"{acceptance['task']} ({acceptance['dtype']})",
                         "one_token_seconds": timing["seconds"][1], "verify_seconds": timing["seconds"][k + 1],
                         "draft_round_seconds": drafts[(dtype, k)]["draft_round_seconds"],
                         "derived_speedup": tokens_per_verify * timing["seconds"][1] / round_seconds})
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
    if report.get("weight_bound_drafting"):
        first = report["weight_bound_drafting"][0]
        lines += ["", f"MTP drafting with a random head (never agrees) on that model, {first['context']}-token "
                      "prompt: time per token against plain greedy"]
        lines.append(f"{'dtype':<9} {'method':<8} {'k':>2} {'tok/s':>8} {'ms/token':>9} {'x plain':>8} "
                     f"{'draft round ms':>15}")
        for row in report["weight_bound_drafting"]:
            head = f"{row['dtype']:<9} {row['method']:<8} {row['draft_tokens']:>2}"
            if "error" in row:
                lines.append(f"{head}  not available: {row['error'][:90]}")
                continue
            draft = f"{row['draft_round_seconds'] * 1e3:>15.1f}" if "draft_round_seconds" in row else f"{'':>15}"
            lines.append(f"{head} {row['tokens_per_second']:>8.2f} {1e3 / row['tokens_per_second']:>9.1f} "
                         f"{1 / row['speedup']:>7.2f}x {draft}")
    if report.get("drafting"):
        clock = "CPU" if report.get("machine", {}).get("clock") == "cpu" else "wall-clock"
        lines += ["", f"Drafting on the trained model (tok/s in {clock} seconds; tokens/verify: tokens each forward "
                      "after the prefill yields; extra cache: reserved + rollback recording + drafter's cache, bytes)"]
        lines.append(f"{'task':<22} {'dtype':<9} {'method':<14} {'k':>2} {'tok/s':>8} {'speedup':>8} "
                     f"{'tok/verify':>10} {'extra cache B':>14} {'= greedy':>9}")
        for row in report["drafting"]:
            task = row["task"] + (f" {row['passage'] + 1}" if "passage" in row else "")
            head = f"{task:<22} {row['dtype']:<9} {row['method']:<14} {row['draft_tokens']:>2}"
            if "error" in row:
                lines.append(f"{head}  not available: {row['error'][:90]}")
                continue
            per_verify = tokens_per_verify(row)
            lines.append(f"{head} {row['tokens_per_second']:>8.2f} {row['speedup']:>7.2f}x {per_verify:>10.2f} "
                         f"{row.get('extra_cache_bytes', 0):>14} {str(row.get('same_tokens_as_greedy', '')):>9}")
    if report.get("copying_summary"):
        first = report["copying_summary"][0]
        lines += ["", f"Copying task over {first['passages']} passages: median speedup over greedy (range), median "
                      "tokens per verify (range)"]
        lines.append(f"{'dtype':<9} {'method':<14} {'k':>2} {'speedup':>8} {'range':>14} {'tok/verify':>10} "
                     f"{'range':>12} {'= greedy':>9}")
        for row in report["copying_summary"]:
            low, high = row["speedup_range"]
            verify_low, verify_high = row["tokens_per_verify_range"]
            lines.append(f"{row['dtype']:<9} {row['method']:<14} {row['draft_tokens']:>2} "
                         f"{row['speedup_median']:>7.2f}x {f'{low:.2f}-{high:.2f}x':>14} "
                         f"{row['tokens_per_verify_median']:>10.2f} {f'{verify_low:.2f}-{verify_high:.2f}':>12} "
                         f"{str(row['same_tokens_as_greedy']):>9}")
    if report.get("derived"):
        lines += ["", "DERIVED (not measured): MTP speedup at the verify widths from the trained head's acceptance, "
                      "(tokens/verify) x t_1 / (t_verify(k+1) + t_draft(k))"]
        lines.append(f"{'dtype':<9} {'k':>2} {'tok/verify':>10} {'t_1 ms':>8} {'t_verify ms':>12} {'t_draft ms':>11} "
                     f"{'derived':>8}")
        for row in report["derived"]:
            lines.append(f"{row['dtype']:<9} {row['draft_tokens']:>2} {row['tokens_per_verify']:>10.2f} "
                         f"{row['one_token_seconds'] * 1e3:>8.1f} {row['verify_seconds'] * 1e3:>12.1f} "
                         f"{row['draft_round_seconds'] * 1e3:>11.1f} {row['derived_speedup']:>7.2f}x")
    return "\n".join(lines)


def machine(args) -> dict:
    import transformers

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "threads": args.threads, "clock": args.clock,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "load_average_at_start": os.getloadavg()}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke test)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="dtypes of the verify-cost model")
    parser.add_argument("--layers", type=int, help="layers of the verify-cost model (a multiple of 4; default 8)")
    parser.add_argument("--hidden-size", type=int, help="hidden size of the verify-cost model (default 2048)")
    parser.add_argument("--verify-context", type=int, help="cached tokens before the verify forwards (default 1024)")
    parser.add_argument("--widths",
                        help="tokens per verify forward, comma-separated, 1 included (default 1,2,3,4,8)")
    parser.add_argument("--repeats", type=int, help="timed rounds (median; default 5)")
    parser.add_argument("--baseline-python", help="interpreter of a checkout to time as 'baseline' in the same run")
    parser.add_argument("--skip-verify", action="store_true", help="no verify-cost or random-head rows")
    parser.add_argument("--skip-drafting", action="store_true", help="no rows on the (trained) drafting model")
    parser.add_argument("--model", help="checkpoint to draft with (default: a random tiny byte-level model)")
    parser.add_argument("--train", metavar="FOLDER",
                        help="train the drafting model first (a byte-level model, then its MTP head with the model "
                             "frozen) into FOLDER, or reuse FOLDER/mtp if it is there, and draft with it")
    parser.add_argument("--base-steps", type=int, default=500, help="--train: steps of the base model")
    parser.add_argument("--mtp-steps", type=int, default=300, help="--train: steps of the MTP head")
    parser.add_argument("--drafting-dtypes", default="float32,bfloat16", help="dtypes of the drafting rows")
    parser.add_argument("--contexts", help="held-out text prompt lengths, comma-separated (default 2048,8192)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per run (default 64)")
    parser.add_argument("--draft-lengths", default="1,2,3", help="MTP draft lengths k")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=5)
    parser.add_argument("--copy-length", type=int, default=200, help="characters of the passage to copy")
    parser.add_argument("--copy-passages", type=int, default=7,
                        help="held-out passages of the copying task, each a prompt of its own (median and range)")
    parser.add_argument("--draft-new-tokens", type=int, help="tokens per run of the random-head rows (default 16)")
    parser.add_argument("--generation-repeats", type=int,
                        help="rounds of every generate() row, methods taking turns (median; default 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: on a machine shared with other work, torch's threads wait "
                             "for each other at every operator and a step can take 20x longer)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="what the drafting rows time: wall-clock seconds (default) or the thread's CPU seconds "
                             "(with one thread, what the work itself costs, without the time other work on a shared "
                             "machine takes from it)")
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
    for name in ("dtypes", "drafting_dtypes"):
        unknown = set(getattr(args, name).split(",")) - {"float32", "bfloat16"}
        if unknown:
            exit_with_error(f"--{name.replace('_', '-')} has {sorted(unknown)}; use float32 and/or bfloat16.")
    if args.copy_passages < 1:
        exit_with_error(f"--copy-passages is {args.copy_passages}; give at least 1 passage for the copying task.")
    if args.model and args.train:
        exit_with_error("give either --model (a trained checkpoint) or --train FOLDER (train one), not both.")
    if args.baseline_python and not os.access(args.baseline_python, os.X_OK):
        exit_with_error(f"--baseline-python {args.baseline_python} is not an executable; give a Python interpreter.")
    return args


def run(args) -> dict:
    """The whole benchmark as a report (what `--json` writes)."""
    report = {"machine": machine(args), "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    if args.train:
        trained = os.path.join(args.train, "mtp")
        if not os.path.isfile(os.path.join(trained, "config.json")):
            train_drafting_model(args.train, base_steps=args.base_steps, mtp_steps=args.mtp_steps, seed=args.seed)
        args.model = trained
        report["settings"]["model"] = trained
    torch.set_num_threads(args.threads)
    if not args.skip_verify:
        report["verify"] = verify_rows(args)
        report["weight_bound_drafting"] = weight_bound_draft_rows(args)
    if not args.skip_drafting:
        report["drafting"] = drafting_rows(args)
        report["copying_summary"] = copying_summary(report["drafting"])
    report["derived"] = derived_speedups(report)
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
