"""Convert a Qwen3-Next or Qwen3.5 text checkpoint into a HybridIndexPool checkpoint.

Every weight is mapped; each full-attention layer becomes an IndexPool layer with the same attention weights and a
freshly initialised indexer (learned pooling starts at the mean). The multi-token-prediction head (`mtp.*`, which
transformers leaves out at load and vLLM serves as `qwen3_next_mtp`) is kept as MTP layers of `mtp_type` 'qwen3_next',
each with a fresh indexer too. Within the token budget (`--index_topk`) the
converted model computes exactly what the source does; beyond it the indexer chooses the attended windows and needs
the indexer training first (see the README).

Reads `Qwen3NextForCausalLM` (`qwen3_next`), `Qwen3_5ForCausalLM` (`qwen3_5_text`), `Qwen3_5MoeForCausalLM`
(`qwen3_5_moe_text`) and the multimodal `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`
folders (their vision tower is left out). It streams shard by shard, so memory stays near the largest shard.

    python -m hybrid_indexpool.scripts.convert_qwen3_next --source Qwen3-Next-80B-A3B-Instruct \\
        --output Qwen3-Next-80B-A3B-IndexPool --index_topk 2048 --index_pool_size 4
"""

from hybrid_indexpool.configuration.configuration_hybrid_indexpool import POOL_WEIGHTINGS
from hybrid_indexpool.conversion import (
    ConversionReport,
    IndexerSettings,
    conversion_argument_parser,
    convert_qwen3_next,
    run_conversion_command,
)


def main(argv=None) -> ConversionReport:
    """Run the converter on the command line `argv` (default `sys.argv[1:]`); returns the report."""
    defaults = IndexerSettings()
    parser = conversion_argument_parser(__doc__, "folder of the Qwen3-Next / Qwen3.5 checkpoint")
    parser.add_argument("--index_n_heads", type=int, default=defaults.n_heads,
                        help=f"indexer query heads (default {defaults.n_heads})")
    parser.add_argument("--index_head_dim", type=int, default=defaults.head_dim,
                        help=f"indexer head width (default {defaults.head_dim})")
    parser.add_argument("--index_topk", type=int, default=defaults.topk,
                        help=f"token budget per query (default {defaults.topk}); within it, outputs equal the source's")
    parser.add_argument("--index_pool_size", type=int, default=defaults.pool_size,
                        help=f"tokens per pooled indexer key (default {defaults.pool_size})")
    parser.add_argument("--index_pool_weighting", choices=POOL_WEIGHTINGS, default=defaults.pool_weighting,
                        help="pooling of the indexer keys (default learned, starting at the mean; see "
                             "HybridIndexPoolConfig.index_pool_weighting)")
    parser.add_argument("--index_head_weights", action="store_true",
                        help="learned per-head indexer weights (DeepSeek style) instead of a plain sum")
    parser.add_argument("--index_sink_windows", type=int, default=defaults.sink_windows,
                        help="first windows always selected, inside the budget (default 0)")
    parser.add_argument("--index_local_windows", type=int, default=defaults.local_windows,
                        help="most recent windows always selected, inside the budget (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the new indexer's initialisation (default 0)")
    args = parser.parse_args(argv)
    indexer = IndexerSettings(
        n_heads=args.index_n_heads, head_dim=args.index_head_dim, topk=args.index_topk,
        pool_size=args.index_pool_size, pool_weighting=args.index_pool_weighting, head_weights=args.index_head_weights,
        sink_windows=args.index_sink_windows, local_windows=args.index_local_windows,
    )
    return run_conversion_command(parser, lambda: convert_qwen3_next(
        args.source, args.output, indexer, seed=args.seed, overwrite=args.overwrite,
        max_shard_size=args.max_shard_size, progress=not args.no_progress,
    ))


if __name__ == "__main__":
    main()
