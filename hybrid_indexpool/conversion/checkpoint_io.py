"""Safetensors checkpoints on disk: the source read through its index and shard headers, the output written in
shards of bounded size with the index `save_pretrained` writes.

File names and the size parser come from `huggingface_hub` / transformers; the shard writer itself is streaming
(tensors arrive one group at a time and a shard is written as soon as it is full), so it cannot hand the whole state
dict to `huggingface_hub.split_torch_state_dict_into_shards`.
"""

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE, SAFETENSORS_WEIGHTS_FILE_PATTERN
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..configuration.configuration_hybrid_indexpool import misspelled_fields
from .errors import ConversionError, names_preview

if TYPE_CHECKING:
    from .engine import ConcatenatedWeight

# Which script converts which source `model_type`, to point a user who picked the wrong one at the right one.
CONVERTER_SCRIPTS = {
    "qwen3_next": "scripts/convert_qwen3_next.py",
    "qwen3_5": "scripts/convert_qwen3_next.py",
    "qwen3_5_text": "scripts/convert_qwen3_next.py",
    "qwen3_5_moe": "scripts/convert_qwen3_next.py",
    "qwen3_5_moe_text": "scripts/convert_qwen3_next.py",
    "qwen4_exp": "scripts/convert_qwen4_exp.py",
    "qwen4_exp_text": "scripts/convert_qwen4_exp.py",
    "glm5_next": "scripts/convert_glm5_next.py",
}



@dataclass(frozen=True)
class FolderRole:
    """What a command reads a checkpoint folder as, for its messages: how they name the folder (`label`) and what a
    user should pass instead of a wrong one (`wanted`)."""

    label: str
    wanted: str


# A converter reads a downloaded checkpoint of a source family; an export reads one of ours.
CONVERTED = FolderRole("Source folder", "pass the folder of a downloaded checkpoint")
EXPORTED = FolderRole("Folder to export", "pass the folder of one of our checkpoints (a converter's output, or a "
                                          "model trained here from one)")


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return tensor.numel() * tensor.element_size()




_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1,
}


def _slice_bytes(tensor_slice) -> int:
    """Bytes of a tensor in a safetensors file, from its header entry (nothing is read)."""
    numel = 1
    for size in tensor_slice.get_shape():
        numel *= size
    return numel * _SAFETENSORS_DTYPE_BYTES[tensor_slice.get_dtype()]



@contextlib.contextmanager
def open_shard(path: Path):
    """`safe_open` a source shard; a damaged or truncated file is a ConversionError that names it."""
    try:
        handle = safe_open(path, framework="pt")
    except Exception as error:  # safetensors' errors have no common public base
        raise ConversionError(f"Source shard {path.name} cannot be read ({error}); the file is damaged or truncated "
                              "(an interrupted download?): re-download it.") from error
    with handle:
        yield handle



def read_json_file(path: Path):
    """The JSON in `path`; a file that is not valid JSON is a ConversionError naming it and where it breaks."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ConversionError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); re-download it or "
                              "fix the file.") from error
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}; "
                              "fix the file (or re-download it).") from error


def misspelled_source_fields(config_class, settings: dict, where: str) -> list[str]:
    """For each key of `settings` (a config.json's object, or its `text_config` / `vision_config`) that is not a field
    of `config_class` but resembles one that `settings` lacks (a typo, which transformers would keep as an attribute
    nobody reads while the field takes its default), a phrase naming both; the same for its sub-configs."""
    found = [f"`{where}{key}` (did you mean `{field}`?)"
             for key, field in misspelled_fields(config_class, settings).items()
             if field is not None and field not in settings]
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if isinstance(settings.get(name), dict) and isinstance(sub_class, type):
            found += misspelled_source_fields(sub_class, settings[name], f"{where}{name}.")
    return found


@dataclass
class SourceCheckpoint:
    """A checkpoint folder to convert: its `config.json` and safetensors weights (one file or an index of shards).

    Opening reads only the config, the index and each shard's header, so the weight names and the shard sizes are
    known before any tensor is read.
    """

    folder: Path
    config: dict
    shard_names: dict[str, list[str]]  # shard file -> the weight names it holds, in file order
    shard_sizes: dict[str, int]  # shard file -> bytes of its tensors

    @classmethod
    def open(cls, folder: str | os.PathLike, role: FolderRole = CONVERTED) -> "SourceCheckpoint":
        """Read the config and the weight layout of `folder`; ConversionError naming whatever is missing, worded
        for what the command reads the folder as (`role`)."""
        folder = Path(folder)
        label = role.label
        if folder.is_file():
            raise ConversionError(
                f"{label} {folder} is a file, not a folder; {role.wanted}: the folder that holds its config.json and "
                f"safetensors files (this file's folder is {folder.parent})."
            )
        if not folder.is_dir():
            raise ConversionError(f"{label} {folder} does not exist; {role.wanted}.")
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ConversionError(f"{label} {folder} has no config.json; it is not a transformers checkpoint: "
                                  f"{role.wanted}.")
        config = read_json_file(config_path)
        if not isinstance(config, dict):
            raise ConversionError(f"{config_path} holds a {type(config).__name__}, not a config (a JSON object of "
                                  "settings); re-download the checkpoint.")
        if (folder / SAFETENSORS_INDEX_FILE).is_file():
            index = read_json_file(folder / SAFETENSORS_INDEX_FILE)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(
                    f"{folder / SAFETENSORS_INDEX_FILE} has no `weight_map`; re-download the checkpoint."
                )
            shards = list(dict.fromkeys(weight_map.values()))
        elif (folder / SAFETENSORS_SINGLE_FILE).is_file():
            weight_map, shards = None, [SAFETENSORS_SINGLE_FILE]
        else:
            raise ConversionError(
                f"{label} {folder} has neither {SAFETENSORS_SINGLE_FILE} nor {SAFETENSORS_INDEX_FILE}; only "
                "safetensors checkpoints are read (re-save a .bin checkpoint with "
                "`save_pretrained(..., safe_serialization=True)`)."
            )
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            raise ConversionError(
                f"{label} {folder} lacks the shard file(s) {names_preview(missing)} listed in "
                f"{SAFETENSORS_INDEX_FILE}; "
                "the download is incomplete: fetch the missing files."
            )
        shard_names, shard_sizes = {}, {}
        for shard in shards:
            with open_shard(folder / shard) as handle:
                shard_names[shard] = list(handle.keys())
                shard_sizes[shard] = sum(
                    _slice_bytes(handle.get_slice(name)) for name in shard_names[shard]
                )
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in shard_names[shard]:
                    raise ConversionError(
                        f"{SAFETENSORS_INDEX_FILE} places weight {name!r} in {shard}, but that file does not hold it; "
                        "the shard and the index do not belong together: re-download the checkpoint."
                    )
        return cls(folder=folder, config=config, shard_names=shard_names, shard_sizes=shard_sizes)

    def transformers_config(self) -> PreTrainedConfig:
        """The source's config as transformers reads it (`AutoConfig`: defaults filled in, old field names mapped).
        A key of config.json that is not a field but resembles a missing one (`num_hidden_layer`), or a config
        transformers refuses, is a ConversionError naming the file and the key; nothing of transformers' defaults
        reaches the message as if the user had written it."""
        path = self.folder / "config.json"
        config_class = CONFIG_MAPPING[self.model_type] if self.model_type in CONFIG_MAPPING else None
        typos = misspelled_source_fields(config_class, self.config, "") if config_class is not None else []
        if typos:
            raise ConversionError(f"{path}: {'; '.join(typos)} is not a field of {config_class.__name__}, so "
                                  "transformers would read that field at its default; fix the key's name.")
        try:
            return AutoConfig.from_pretrained(self.folder)
        except (ValueError, TypeError, KeyError, StrictDataclassError) as error:
            cause = str(error).strip().splitlines()[-1].strip()
            raise ConversionError(f"{path} is not a valid {self.model_type} config: transformers refuses it ({cause}); "
                                  "fix the file (or re-download it).") from error

    def shards(self) -> list[str]:
        """Shard file names in order."""
        return list(self.shard_names)

    @property
    def weight_names(self) -> list[str]:
        """Every weight name of the checkpoint, shard by shard."""
        return [name for names in self.shard_names.values() for name in names]

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def tensor_header(self, name: str) -> tuple[list[int], str]:
        """Shape and safetensors dtype (`"BF16"`, ...) of weight `name`, read from its shard's header only."""
        shard = next(shard for shard, names in self.shard_names.items() if name in names)
        with open_shard(self.folder / shard) as handle:
            tensor_slice = handle.get_slice(name)
            return list(tensor_slice.get_shape()), tensor_slice.get_dtype()

    def load_shard(self, shard: str) -> dict[str, torch.Tensor]:
        """The tensors of one shard file (and nothing else)."""
        with open_shard(self.folder / shard) as handle:
            try:
                return {name: handle.get_tensor(name) for name in handle.keys()}
            except Exception as error:  # safetensors' errors have no common public base
                raise ConversionError(f"Source shard {shard} cannot be read ({error}); it is damaged or truncated: "
                                      "re-download it.") from error

    def require_model_type(self, accepted: Iterable[str], script: str) -> str:
        """Return the source's `model_type` if `script` converts it; else ConversionError naming what was found and
        which script converts it."""
        accepted = list(accepted)
        model_type = self.model_type
        if model_type in accepted:
            return model_type
        found = f"model_type {model_type!r} (architectures {self.config.get('architectures')})"
        other = CONVERTER_SCRIPTS.get(model_type)
        hint = f"use {other} for it." if other else "no converter of this project reads it."
        raise ConversionError(
            f"{self.folder} holds a {found} checkpoint; {script} converts only model types {accepted}: {hint}"
        )



class ConcatenationFile:
    """A safetensors file holding one tensor, written part by part along dim 0.

    The header (name, dtype, full shape) is written first from the parts' headers; each part's bytes follow in order
    (a row-major tensor concatenated along dim 0 is its parts' bytes one after another). Parts that arrive early wait.
    """

    def __init__(self, path: Path, concatenation: "ConcatenatedWeight", headers: list[tuple[list[int], str]]):
        shapes, dtypes = [shape for shape, _ in headers], {dtype for _, dtype in headers}
        if len(dtypes) != 1 or any(len(shape) < 1 or shape[1:] != shapes[0][1:] for shape in shapes):
            raise ConversionError(
                f"The parts of {concatenation.target} ({names_preview(concatenation.sources, 2)}) differ in dtype "
                "or in "
                f"their trailing shape ({sorted(dtypes)}, {shapes[:3]}...); they cannot be concatenated."
            )
        self.dtype = dtypes.pop()
        self.shape = [sum(shape[0] for shape in shapes), *shapes[0][1:]]
        self.part_bytes = [math.prod(shape) * _SAFETENSORS_DTYPE_BYTES[self.dtype] for shape in shapes]
        self.nbytes = sum(self.part_bytes)
        header = {concatenation.target: {"dtype": self.dtype, "shape": self.shape, "data_offsets": [0, self.nbytes]},
                  "__metadata__": {"format": "pt"}}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
        self.handle = open(path, "wb")
        self.handle.write(struct.pack("<Q", len(encoded)) + encoded)
        self.next_part, self.waiting, self.waiting_bytes = 0, {}, 0

    def add(self, index: int, tensor: torch.Tensor) -> None:
        """Take part `index`; write it (and any waiting parts after it) once every earlier part is written."""
        raw = tensor.contiguous().view(torch.uint8).reshape(-1)
        if raw.numel() != self.part_bytes[index]:
            raise ConversionError(f"Part {index} has {raw.numel()} bytes; its header said {self.part_bytes[index]}.")
        self.waiting[index] = raw
        self.waiting_bytes += raw.numel()
        while self.next_part in self.waiting:
            part = self.waiting.pop(self.next_part)
            self.waiting_bytes -= part.numel()
            self.handle.write(part.numpy())  # the buffer itself, no copy
            self.next_part += 1
        if self.next_part == len(self.part_bytes):
            self.handle.close()


class ShardWriter:
    """Buffers built tensors and writes them out as numbered shards of at most `max_shard_size` bytes (a single
    larger tensor gets a shard of its own)."""

    def __init__(self, folder: Path, max_shard_size: int):
        self.folder, self.max_shard_size = folder, max_shard_size
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # provisional file name, tensor names
        self.total_bytes = self.total_parameters = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Buffer `tensor` under `name`, first writing out the buffer if `tensor` would overflow it."""
        size = tensor_bytes(tensor)
        if self.buffer and self.buffer_bytes + size > self.max_shard_size:
            self.flush()
        self.buffer[name] = tensor
        self.buffer_bytes += size
        self.total_bytes += size
        self.total_parameters += tensor.numel()

    def flush(self) -> None:
        """Write the buffered tensors as the next shard."""
        if not self.buffer:
            return
        file_name = f"shard-{len(self.files) + 1:05d}.safetensors"
        save_file(self.buffer, self.folder / file_name, metadata={"format": "pt"})
        self.files.append((file_name, list(self.buffer)))
        self.buffer, self.buffer_bytes = {}, 0

    def add_concatenation(self, concatenation: "ConcatenatedWeight", headers: list) -> ConcatenationFile:
        """A file of its own for a streamed concatenation, numbered among the shards."""
        file_name = f"shard-{len(self.files) + 1:05d}.safetensors"
        stream = ConcatenationFile(self.folder / file_name, concatenation, headers)
        self.files.append((file_name, [concatenation.target]))
        self.total_bytes += stream.nbytes
        self.total_parameters += math.prod(stream.shape)
        return stream

    def finish(self) -> dict[str, str]:
        """Flush, give the shards their final names (as `save_pretrained` names them) and write the index."""
        self.flush()
        if len(self.files) == 1:
            (self.folder / self.files[0][0]).rename(self.folder / SAFETENSORS_SINGLE_FILE)
            return {name: SAFETENSORS_SINGLE_FILE for name in self.files[0][1]}
        weight_map = {}
        for number, (file_name, names) in enumerate(self.files, start=1):
            final = SAFETENSORS_WEIGHTS_FILE_PATTERN.format(suffix=f"-{number:05d}-of-{len(self.files):05d}")
            (self.folder / file_name).rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {
            "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.folder / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return weight_map


