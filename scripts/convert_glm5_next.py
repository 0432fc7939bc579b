"""Convert a GLM-5.3-Flash checkpoint (`Glm5NextForConditionalGeneration`) into a HybridIndexPool checkpoint that
computes the same.

GLM-5.3-Flash is already an IndexPool model: its sparse MLA layers' indexer keeps one learned weighted-pooled key per
`index_kpool` tokens (`softmax(G x + ape)` per channel over `LayerNorm(W_k x)`), selects `index_topk / r` pools per
query plus the open tail, and `"shared"` layers reuse the previous layer's selection. Every part maps to a variant of
ours: Kimi Delta Attention (`linear_attention_type="kimi_delta"`), MLA without RoPE (`attention_type="mla"`), the
indexer (queries from the attention's q_lora residual, LayerNorm before pooling, no RoPE, head weights, learned pooling
with the source's gate and slot bias), Sinkhorn residual streams (`hc_type="sinkhorn"`), group-routed MoE with an
ungated shared expert and the SwiGLU clamp, RMSNorms scaling by their weight as GLM's do (`rms_norm_unit_offset`
False). transformers' cache keeps every token's indexer key and gate; the converted model keeps one pooled key per
window, prefills in bounded chunks and compiles its decode step.

The vision tower (transformers' `Glm5NextVisionModel`) and the processor files are kept: the output is our
`HybridIndexPoolForConditionalGeneration` (image-text-to-text); `--text_only` converts the language model alone into
our causal LM. The multi-token-prediction (next-n) layers are kept as our MTP layers. It streams shard by shard, so
memory stays near the largest shard, not the model. `scripts/export_glm5_next.py` writes the result (fine-tuned or
not) back in GLM's format.

    python -m hybrid_indexpool.scripts.convert_glm5_next --source GLM-5.3-Flash --output GLM-5.3-Flash-IndexPool
"""

from hybrid_indexpool.conversion import (
    ConversionReport,
    conversion_argument_parser,
    convert_glm5_next,
    run_conversion_command,
)


def main(argv=None) -> ConversionReport:
    """Run the converter on the command line `argv` (default `sys.argv[1:]`); returns the report."""
    parser = conversion_argument_parser(__doc__, "folder of the GLM-5.3-Flash checkpoint")
    parser.add_argument("--text_only", action="store_true",
                        help="convert the language model alone (our causal LM, no vision tower)")
    args = parser.parse_args(argv)
    return run_conversion_command(parser, lambda: convert_glm5_next(
        args.source, args.output, text_only=args.text_only, overwrite=args.overwrite,
        max_shard_size=args.max_shard_size, progress=not args.no_progress,
    ))


if __name__ == "__main__":
    main()
