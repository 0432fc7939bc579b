"""Export a HybridIndexPool checkpoint converted from Qwen4-Exp (and perhaps fine-tuned here since) back to
Qwen4-Exp's format: transformers' `Qwen4ExpForConditionalGeneration` (with a vision tower) or `Qwen4ExpForCausalLM`
loads it, and so do the engines that serve Qwen3.8-Flash-Next natively (vLLM, SGLang) with their own kernels.

The conversion's plan runs backwards: every weight goes back under Qwen4-Exp's name (the fused indexer projection,
per-expert MoE weights, the n-gram tables in their parts), the vision tower and the tokenizer and processor files are
copied, and the config is the source's as stored at conversion with every setting ours carries taken from ours.
Exported unchanged, a converted checkpoint gives back the source's tensors bit for bit. Qwen4-Exp's QSA pools by the
mean: learned pooling that has moved from the mean is refused, as is any setting the format cannot express (named);
LoRA adapters must be merged first. It streams shard by shard; the output appears only once complete.

    python -m hybrid_indexpool.scripts.export_qwen4_exp --source Qwen3.8-Flash-Next-IndexPool-finetuned \\
        --output Qwen3.8-Flash-Next-finetuned
    vllm serve Qwen3.8-Flash-Next-finetuned   # the engine's own command, no plugin
"""

from hybrid_indexpool.conversion import ConversionReport, export_qwen4_exp, run_export_command


def main(argv=None) -> ConversionReport:
    """Run the export on the command line `argv` (default `sys.argv[1:]`); returns the report."""
    return run_export_command(__doc__, "Qwen4-Exp", export_qwen4_exp, argv)


if __name__ == "__main__":
    main()
