"""Which kernels compute the Gated DeltaNet core in vLLM: vLLM's own, or the project's (`gated_deltanet.py`).

vLLM's CPU kernels take bfloat16 and head sizes 64 and 128 only (others fail at the first request); the project's
PyTorch core takes any dtype and head size. The engine option `additional_config = {"hybrid_indexpool_gdn_kernel":
...}` chooses: `"auto"` (default: vLLM's kernels where they run, the project's otherwise), `"vllm"` or `"project"`.
Nothing here imports vLLM's model code: the engine-start checks (`vllm_config.py`) read it in every vLLM process.
"""

import torch

GDN_KERNEL_OPTION = "hybrid_indexpool_gdn_kernel"
GDN_KERNELS = ("auto", "vllm", "project")
# The Gated DeltaNet head sizes vLLM's CPU kernels (`chunk_gated_delta_rule_cpu`) take.
VLLM_CPU_GDN_HEAD_DIMS = (64, 128)


def requested_gdn_kernel(vllm_config) -> str:
    """The value of the engine option (`"auto"` when not given)."""
    options = vllm_config.additional_config
    return options.get(GDN_KERNEL_OPTION, "auto") if isinstance(options, dict) else "auto"


def vllm_gdn_kernel_limits(vllm_config) -> list[str]:
    """Why vLLM's own Gated DeltaNet kernels cannot run this model here (empty when they can): on CPU, a dtype other
    than bfloat16 or a head size other than 64 or 128."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    config, dtype = vllm_config.model_config.hf_text_config, vllm_config.model_config.dtype
    limits = []
    if dtype != torch.bfloat16:
        limits.append(f"dtype = {dtype} (vLLM's CPU Gated DeltaNet takes bfloat16 only)")
    for name in ("linear_key_head_dim", "linear_value_head_dim"):
        if getattr(config, name) not in VLLM_CPU_GDN_HEAD_DIMS:
            limits.append(f"{name} = {getattr(config, name)} (vLLM's CPU Gated DeltaNet takes "
                          f"{' or '.join(map(str, VLLM_CPU_GDN_HEAD_DIMS))})")
    return limits


def gdn_kernel(vllm_config) -> str:
    """`"vllm"` or `"project"`: the kernels that compute the Gated DeltaNet core of this engine."""
    requested = requested_gdn_kernel(vllm_config)
    if requested != "auto":
        return requested
    return "project" if vllm_gdn_kernel_limits(vllm_config) else "vllm"


def gdn_kernel_problems(vllm_config) -> list[str]:
    """Why the requested Gated DeltaNet kernels cannot serve this engine (empty when they can)."""
    requested = requested_gdn_kernel(vllm_config)
    if requested not in GDN_KERNELS:
        return [f"additional_config['{GDN_KERNEL_OPTION}'] = {requested!r} (use one of {list(GDN_KERNELS)})"]
    if requested != "vllm":
        return []
    return [f"{limit}, with additional_config['{GDN_KERNEL_OPTION}'] = 'vllm' (leave it out or set 'project' to run "
            "the project's Gated DeltaNet core)" for limit in vllm_gdn_kernel_limits(vllm_config)]
