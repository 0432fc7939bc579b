"""Demo: build a small random HybridIndexPool model, generate from a prompt longer than its budget, and print the
speed and the cache size per component (in use and reserved), pooled against what an unpooled (r = 1) indexer
would hold. With `--image`, the multimodal model reads a generated picture in the middle of the prompt.

    python -m hybrid_indexpool.scripts.demo --prompt-length 1024 --new-tokens 32
    python -m hybrid_indexpool.scripts.demo --image
"""

import argparse
import time

import torch

from hybrid_indexpool import (
    HybridIndexPoolConfig,
    HybridIndexPoolForCausalLM,
    HybridIndexPoolForConditionalGeneration,
    HybridIndexPoolMultimodalConfig,
)

# The demo's multimodal model: Qwen4-Exp's vision tower (16-pixel patches, 2 frames per patch, 2 x 2 merged).
PATCH, TEMPORAL_PATCH, MERGE = 16, 2, 2
IMAGE_TOKEN, VISION_START, VISION_END = 1020, 1021, 1022


def demo_text_config(pool_size: int, topk: int, **overrides) -> HybridIndexPoolConfig:
    """An 8-layer model (6 Gated DeltaNet + 2 IndexPool layers), about 5M parameters."""
    return HybridIndexPoolConfig(**{
        **dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, index_n_heads=4, index_head_dim=64, index_topk=topk,
               index_pool_size=pool_size, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
               linear_value_head_dim=32, eos_token_id=None, pad_token_id=0),
        **overrides,
    })


def build_demo_model(pool_size: int, topk: int, seed: int) -> HybridIndexPoolForCausalLM:
    """The randomly initialised text model."""
    torch.manual_seed(seed)
    return HybridIndexPoolForCausalLM(demo_text_config(pool_size, topk)).eval()


def build_demo_multimodal_model(pool_size: int, topk: int, seed: int) -> HybridIndexPoolForConditionalGeneration:
    """The text model with multimodal RoPE behind a 2-block Qwen4-Exp vision tower, randomly initialised."""
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2]}
    config = HybridIndexPoolMultimodalConfig(
        text_config=demo_text_config(pool_size, topk, rope_parameters=rope),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
                           patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE),
        image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        video_token_id=1023,
    )
    return HybridIndexPoolForConditionalGeneration(config).eval()


def picture_patches(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A generated RGB picture (colour gradients) cut into the vision tower's input the way Qwen-VL processors cut
    an image: `pixel_values [patches, 3 * 2 * 16 * 16]` (the picture repeated over the 2 frames of a temporal patch,
    patches ordered by 2 x 2 merge group) and `image_grid_thw [[1, height / 16, width / 16]]`."""
    rows, columns = torch.linspace(-1, 1, height), torch.linspace(-1, 1, width)
    picture = torch.stack([rows[:, None].expand(height, width), columns[None].expand(height, width),
                           (rows[:, None] * columns[None])])  # [3, height, width], already normalised
    grid_h, grid_w = height // PATCH, width // PATCH
    frames = picture[None].expand(TEMPORAL_PATCH, -1, -1, -1)  # [2, 3, height, width]
    patches = frames.reshape(1, TEMPORAL_PATCH, 3, grid_h // MERGE, MERGE, PATCH, grid_w // MERGE, MERGE, PATCH)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # grid_t, merge groups, within a group, C, T, P, P
    return patches.reshape(grid_h * grid_w, -1), torch.tensor([[1, grid_h, grid_w]])


# What each component of the cache table holds.
CACHE_COMPONENTS = {
    "key_value": "keys and values of the IndexPool layers, one entry per token",
    "pooled_index_keys": "the indexer's keys, pooled: one key per window of r tokens",
    "open_window": "raw indexer keys of each row's unfinished window, pooled once it fills",
    "conv_state": "the last inputs of each Gated DeltaNet convolution (fixed size)",
    "recurrent_state": "each Gated DeltaNet layer's state matrices (fixed size)",
    "bookkeeping": "lengths and positions of each row",
}
# The demo's flags for the config fields they set, to name in an error.
FLAG_OF_FIELD = {"index_pool_size": "--pool-size", "index_topk": "--topk"}


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad flags with `error: ...` and exit status 2, naming the flags (not the config fields they set)."""
    for flag in ("prompt_length", "new_tokens", "pool_size", "topk"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} is {getattr(args, flag)}; give a positive number.")
    if args.prompt_length <= args.topk:
        parser.error(f"--prompt-length ({args.prompt_length}) must exceed --topk ({args.topk}) to show sparsity")
    if args.image and args.prompt_length < 40:
        parser.error(f"--prompt-length ({args.prompt_length}) leaves no room around the picture's 18 tokens; give "
                     "at least 40 with --image.")
    try:
        demo_text_config(args.pool_size, args.topk)
    except ValueError as error:
        message = str(error).removeprefix("HybridIndexPoolConfig: ")
        for field, flag in FLAG_OF_FIELD.items():
            message = message.replace(f"`{field}`", flag).replace(field, flag)
        parser.error(message)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a device PyTorch knows; use e.g. cpu or cuda.")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device} needs a CUDA GPU, and this machine has none; use --device cpu.")


def format_bytes(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{size} B"
        size /= 1024
    raise AssertionError("unreachable")


def run_demo(prompt_length: int, new_tokens: int, pool_size: int, topk: int, seed: int, device: str,
             image: bool = False) -> dict:
    """Generate greedily and return timings and the cache footprint (a dict, for tests and printing). With `image`,
    a 64 x 128 picture (16 tokens) sits in the middle of the prompt."""
    vision = {}
    if image:
        model = build_demo_multimodal_model(pool_size, topk, seed).to(device)
        pixel_values, grid = picture_patches(64, 128)
        placeholders = [VISION_START] + [IMAGE_TOKEN] * (int(grid.prod()) // MERGE**2) + [VISION_END]
        text = torch.randint(1, 1000, (prompt_length - len(placeholders),)).tolist()
        middle = len(text) // 2
        prompt = torch.tensor([text[:middle] + placeholders + text[middle:]], device=device)
        vision = {"pixel_values": pixel_values.to(device), "image_grid_thw": grid.to(device)}
    else:
        model = build_demo_model(pool_size, topk, seed).to(device)
        prompt = torch.randint(1, 1000, (1, prompt_length), device=device)
    with torch.no_grad():
        start = time.perf_counter()
        output = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                                **vision)
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
    parser.add_argument("--image", action="store_true",
                        help="the multimodal model, with a generated picture in the middle of the prompt")
    args = parser.parse_args(argv)
    check_arguments(parser, args)

    result = run_demo(args.prompt_length, args.new_tokens, args.pool_size, args.topk, args.seed, args.device,
                      args.image)
    footprint = result["footprint"]
    kind = "multimodal model (a 64 x 128 picture in the prompt)" if args.image else "model"
    print(f"{kind}: {result['parameters'] / 1e6:.2f}M parameters, r = {args.pool_size}, budget = {args.topk} tokens, "
          f"device = {args.device}")
    print(f"generated {args.new_tokens} tokens after a {args.prompt_length}-token prompt in "
          f"{result['seconds']:.2f} s ({result['tokens_per_second']:.1f} tokens/s, prefill included)")
    print(f"first generated ids: {result['generated'][:10]}")
    print(f"\ncache at {result['context']} tokens of context (reserved once by generate() for prompt + new tokens):")
    print(f"  {'component':<20}{'in use':>12}{'reserved':>12}  what it holds")
    for name, meaning in CACHE_COMPONENTS.items():
        print(f"  {name:<20}{format_bytes(footprint[name]):>12}{format_bytes(footprint[name + '_reserved']):>12}  "
              f"{meaning}")
    print(f"  {'total':<20}{format_bytes(footprint['total']):>12}{format_bytes(footprint['reserved']):>12}")
    unpooled = footprint["unpooled_index_keys"]
    print(f"\nindexer keys: pooled {format_bytes(footprint['pooled_index_keys'])} vs unpooled (r = 1) "
          f"{format_bytes(unpooled)}: {footprint['pooled_index_keys'] / max(unpooled, 1):.1%} of the unpooled size")


if __name__ == "__main__":
    main()
