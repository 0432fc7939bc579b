"""Export a HybridIndexPool checkpoint converted from GLM-5.3-Flash (and perhaps fine-tuned here since) back to
GLM-5.3-Flash's format: transformers' `Glm5NextForConditionalGeneration` loads it, and so do the engines that serve
GLM-5.3-Flash natively (vLLM, SGLang) with their own kernels.

The conversion's plan runs backwards: every weight goes back under GLM's name (per-expert MoE weights, the three KDA
convolutions, the indexer's pooling gate and slot bias), the vision tower and the tokenizer and processor files are
copied, and the config is the source's as stored at conversion with every setting ours carries taken from ours.
Exported unchanged, a converted checkpoint gives back the source's tensors bit for bit. A setting GLM's format cannot
express (a variant of ours GLM lacks, a text-only model) is refused with the setting named; LoRA adapters must be
merged first. It streams shard by shard; the output appears only once complete.

    python -m hybrid_indexpool.scripts.export_glm5_next --source GLM-5.3-Flash-IndexPool-finetuned \\
        --output GLM-5.3-Flash-finetuned
    vllm serve GLM-5.3-Flash-finetuned   # the engine's own command, no plugin
"""

from hybrid_indexpool.conversion import ConversionReport, export_glm5_next, run_export_command


def main(argv=None) -> ConversionReport:
    """Run the export on the command line `argv` (default `sys.argv[1:]`); returns the report."""
    return run_export_command(__doc__, "GLM-5.3-Flash", export_glm5_next, argv)


if __name__ == "__main__":
    main()
