"""Demo: build a small random HybridIndexPool model, generate from a prompt longer than its budget, and print the
speed and the cache size per component, pooled against what an unpooled (r = 1) indexer would hold.

    python -m hybrid_indexpool.scripts.demo --prompt-length 1024 --new-tokens 32
"""

import argparse
import time

import torch

from hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolForCausalLM


def build_demo_model(pool_size: int, topk: int, seed: int) -> HybridIndexPoolForCausalLM:
    """A randomly initialised 8-layer model (6 Gated DeltaNet + 2 IndexPool layers), about 5M parameters."""
    torch.manual_seed(seed)
    config = HybridIndexPoolConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, index_n_heads=4, index_head_dim=64,
        index_topk=topk, index_pool_size=pool_size, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, eos_token_id=None, pad_token_id=0,
    )
    return HybridIndexPoolForCausalLM(config).eval()


def format_bytes(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{size} B"
        size /= 1024
    raise AssertionError("unreachable")


def run_demo(prompt_length: int, new_tokens: int, pool_size: int, topk: int, seed: int, device: str) -> dict:
    """Generate greedily and return timings and the cache footprint (a dict, for tests and printing)."""
    model = build_demo_model(pool_size, topk, seed).to(device)
    prompt = torch.randint(1, model.config.vocab_size, (1, prompt_length), device=device)
    with torch.no_grad():
        start = time.perf_counter()
        output = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
        elapsed = time.perf_counter() - start
    return {
        "parameters": model.num_parameters(),
        "generated": output.sequences[0, prompt_length:].tolist(),
        "seconds": elapsed,
        "tokens_per_second": new_tokens / elapsed,
        "footprint": output.cache.memory_footprint(),
        "context": output.sequences.shape[1],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-length", type=int, default=1024, help="prompt tokens (default 1024)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--pool-size", type=int, default=4, help="index_pool_size r (default 4)")
    parser.add_argument("--topk", type=int, default=128, help="index_topk token budget (default 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.prompt_length <= args.topk:
        parser.error(f"--prompt-length ({args.prompt_length}) must exceed --topk ({args.topk}) to show sparsity")

    result = run_demo(args.prompt_length, args.new_tokens, args.pool_size, args.topk, args.seed, args.device)
    footprint = result["footprint"]
    print(f"model: {result['parameters'] / 1e6:.2f}M parameters, r = {args.pool_size}, budget = {args.topk} tokens, "
          f"device = {args.device}")
    print(f"generated {args.new_tokens} tokens after a {args.prompt_length}-token prompt in "
          f"{result['seconds']:.2f} s ({result['tokens_per_second']:.1f} tokens/s, prefill included)")
    print(f"first generated ids: {result['generated'][:10]}")
    print(f"\ncache at {result['context']} tokens of context:")
    print(f"  {'component':<22}{'bytes':>14}")
    for name in ("key_value", "pooled_index_keys", "open_window", "conv_state", "recurrent_state", "total"):
        print(f"  {name:<22}{format_bytes(footprint[name]):>14}")
    unpooled = footprint["unpooled_index_keys"]
    print(f"\nindexer keys: pooled {format_bytes(footprint['pooled_index_keys'])} vs unpooled (r = 1) "
          f"{format_bytes(unpooled)}: {footprint['pooled_index_keys'] / max(unpooled, 1):.1%} of the unpooled size")


if __name__ == "__main__":
    main()
