"""Run by `torchrun --nproc_per_node 2` from tests/test_distributed.py: load each saved tiny model with transformers'
tensor or pipeline parallelism, run a forward and greedy `generate()` on the saved left-padded batch, and save this
rank's logits, tokens and cache shapes next to the model."""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hybrid_indexpool  # noqa: F401  (registers the model with the Auto classes)


def run(folder: Path, distributed_config: DistributedConfig, name: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=distributed_config, dtype=torch.float32)
    inputs = torch.load(folder / "inputs.pt")
    new_tokens = inputs.pop("max_new_tokens")
    with torch.no_grad():
        logits = model(**inputs).logits
        output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    shapes = []
    for layer in output.cache.layers:
        if getattr(layer, "key_storage", None) is not None:
            shapes.append(("indexpool", tuple(layer.key_storage.shape), tuple(layer.value_storage.shape)))
        elif getattr(layer, "recurrent_states", {0: None})[0] is not None:
            shapes.append(("linear", tuple(layer.conv_states[0].shape), tuple(layer.recurrent_states[0].shape)))
        else:
            shapes.append(("other stage", None, None))
    rank = torch.distributed.get_rank()
    torch.save({"logits": logits, "tokens": output.sequences, "cache_shapes": shapes}, folder / f"{name}.{rank}.pt")


def main(root: str) -> None:
    """`root/cases.json` maps each model folder under `root` to the parallelisms to run it with ("tp", "pp")."""
    root = Path(root)
    for name, kinds in json.loads((root / "cases.json").read_text()).items():
        for kind in kinds:
            size = {"tp": {"tp_size": 2}, "pp": {"pp_size": 2}}[kind]
            run(root / name, DistributedConfig(**size), kind)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
