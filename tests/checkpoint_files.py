"""What a checkpoint folder holds, read back for comparisons: its tensors and its config."""

import json
from pathlib import Path

import torch
from safetensors import safe_open


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, by name."""
    tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def config_dict(folder: Path) -> dict:
    """The folder's config.json without the transformers version that wrote it."""
    config = json.loads((Path(folder) / "config.json").read_text())
    config.pop("transformers_version", None)
    return config


def differing_tensors(first: Path, second: Path) -> list[str]:
    """The names whose tensors differ between two checkpoint folders in dtype or in any bit, and the names only one
    of them holds."""
    ours, theirs = saved_tensors(first), saved_tensors(second)
    return sorted(set(ours) ^ set(theirs)) + [
        name for name in ours if name in theirs
        and (ours[name].dtype != theirs[name].dtype or not torch.equal(ours[name], theirs[name]))]
