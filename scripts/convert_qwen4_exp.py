"""Convert a Qwen4-Exp checkpoint (Qwen3.8-Flash-Next) into a HybridIndexPool checkpoint that computes the same.

Qwen4-Exp's QSA indexer mean-pools every 4 indexer keys per query at run time and caches the raw keys; ours caches
one pooled key per window (a 4x smaller indexer cache) and pools with learned weights that start at the mean, so
the converted model gives the source's outputs and its pooling can then be trained. Every other part maps one to one:
Gated DeltaNet, gated attention, MoE (per-expert weights on disk are fused), hyper-connections and the per-layer
n-gram embeddings (whose table, split in parts on disk, is written as one tensor, streamed part by part).

Reads `Qwen4ExpForCausalLM` (`qwen4_exp_text`) and the multimodal `Qwen4ExpForConditionalGeneration` (`qwen4_exp`)
folders. A multimodal source becomes our `HybridIndexPoolForConditionalGeneration`: transformers' Qwen4-Exp vision
tower with the source's weights, our text model with its multimodal RoPE, and the source's processor files (so
`AutoProcessor.from_pretrained(output)` works); `--text_only` converts its language model alone into our causal LM.
It streams shard by shard, so memory stays near the largest shard, not the model (the real model has about 180B
parameters). The MTP head is kept as our MTP layers. `scripts/export_qwen4_exp.py` writes the result (fine-tuned or
not) back in Qwen4-Exp's format.

    python -m hybrid_indexpool.scripts.convert_qwen4_exp --source Qwen3.8-Flash-Next --output Qwen3.8-Flash-IndexPool
"""

from hybrid_indexpool.conversion import (
    ConversionReport,
    conversion_argument_parser,
    convert_qwen4_exp,
    run_conversion_command,
)


def main(argv=None) -> ConversionReport:
    """Run the converter on the command line `argv` (default `sys.argv[1:]`); returns the report."""
    parser = conversion_argument_parser(__doc__, "folder of the Qwen4-Exp checkpoint")
    parser.add_argument("--index_pool_weighting", choices=("learned", "mean"), default="learned",
                        help="pooling of the indexer keys (default learned, starting exactly at Qwen4-Exp's mean)")
    parser.add_argument("--text_only", action="store_true",
                        help="of a multimodal checkpoint, convert the language model alone (our causal LM, no vision)")
    args = parser.parse_args(argv)
    return run_conversion_command(parser, lambda: convert_qwen4_exp(
        args.source, args.output, pool_weighting=args.index_pool_weighting, text_only=args.text_only,
        overwrite=args.overwrite, max_shard_size=args.max_shard_size, progress=not args.no_progress,
    ))


if __name__ == "__main__":
    main()
