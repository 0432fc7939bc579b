"""Qwen4-Exp's hyper-connections (`hc_count > 1`, `hc_type = "qwen4_exp"`) in the vLLM model: vLLM's own
`GatedResidual` (its Qwen4-Exp module, plain PyTorch, so it runs on every build), configured as our checkpoints are.

The layer carries `hc_count` residual streams `[tokens, hc_count * hidden]`; each block reads them through a
hyper-connection's `mix` (per-stream RMSNorm, low-rank sigmoid gate, mean) and writes its output back with `combine`
(per-stream gate `2 * sigmoid`). The model starts every stream as the embedding and ends with a mix of its own,
without a final norm. The weights load under the checkpoint's names (`hc_norm`, `input_mix_weight_down`/`_up`,
`block_inject_weight`). Under tensor parallelism the streams are whole on every rank and so are these weights.
"""

import torch
from vllm.models.qwen4_exp.common.hyperconnection import GatedResidual, HyperConnectionConfig


def hyper_connection(config, dtype: torch.dtype, inject: bool = True) -> GatedResidual:
    """vLLM's gated hyper-connection for our `config` (streams normed one by one, as our checkpoints' `hc_norm`
    of `hc_count * hidden` weights is); `inject = False` for the model's final mix."""
    settings = HyperConnectionConfig(hc_count=config.hc_count, hidden_size=config.hidden_size, params_dtype=dtype,
                                     hc_lowrank=config.hc_lowrank, rms_norm_eps=config.rms_norm_eps,
                                     hc_per_branch_norm=True)
    return GatedResidual(settings, use_combine=inject)

