"""Streaming conversion of pretrained checkpoints into HybridIndexPool checkpoints.

A converter is a declarative [`ConversionPlan`]: weight groups, each naming the source tensors it needs and a function
that builds one or more of our tensors from them (a rename, a split of a fused projection, a fusion of per-expert
weights), plus ignore rules for source weights we deliberately leave out (a vision tower, an MTP head).
[`convert_checkpoint`] checks the plan against the source's weight names before reading any tensor, then streams:
one source shard at a time, each group built as soon as all its sources have arrived, results written to output
shards of bounded size. Peak memory therefore follows the largest shard, not the model.

    source = SourceCheckpoint.open("Qwen3-Next-80B-A3B-Instruct")
    report = convert_checkpoint(source, plan, config, "converted", max_shard_size="5GB")
    print(report.summary())
"""

import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import struct
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, GenerationConfig
from transformers.utils.hub import convert_file_size_to_int

from .configuration import HybridIndexPoolConfig
from .modeling import (
    HybridIndexPoolForCausalLM,
    HybridIndexPoolForConditionalGeneration,
    HybridIndexPoolPreTrainedModel,
)
from .modeling.hub_export import auto_map_for, write_model_card, write_remote_code

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Copied verbatim from the source folder when present: the tokenizer and the generation defaults.
COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    # A multimodal checkpoint's processor: AutoProcessor.from_pretrained(output) reads them.
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)
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


class ConversionError(ValueError):
    """A checkpoint cannot be converted; the message names what is wrong and how to fix it."""


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return tensor.numel() * tensor.element_size()


def _names_preview(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


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


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived during a conversion: raised so that the partial output is removed, as on Ctrl-C."""


@contextlib.contextmanager
def _terminate_as_exception():
    """While converting, turn SIGTERM and SIGHUP into `Terminated` (only the main thread can install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"conversion stopped by signal {signal.Signals(signum).name}")

    names = [name for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    previous = {name: signal.signal(getattr(signal, name), handler) for name in names}
    try:
        yield
    finally:
        for name, old in previous.items():
            signal.signal(getattr(signal, name), old)


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
    def open(cls, folder: str | os.PathLike) -> "SourceCheckpoint":
        """Read the config and the weight layout of `folder`; ConversionError naming whatever is missing."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ConversionError(f"Source folder {folder} does not exist; pass the folder of a downloaded checkpoint.")
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ConversionError(f"Source folder {folder} has no config.json; it is not a transformers checkpoint.")
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if (folder / INDEX_FILE).is_file():
            weight_map = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8")).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{folder / INDEX_FILE} has no `weight_map`; re-download the checkpoint.")
            shards = list(dict.fromkeys(weight_map.values()))
        elif (folder / SINGLE_FILE).is_file():
            weight_map, shards = None, [SINGLE_FILE]
        else:
            raise ConversionError(
                f"Source folder {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors checkpoints "
                "are converted (re-save a .bin checkpoint with `save_pretrained(..., safe_serialization=True)`)."
            )
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            raise ConversionError(
                f"Source folder {folder} lacks the shard file(s) {_names_preview(missing)} listed in {INDEX_FILE}; "
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
                        f"{INDEX_FILE} places weight {name!r} in {shard}, but that file does not hold it; "
                        "the shard and the index do not belong together: re-download the checkpoint."
                    )
        return cls(folder=folder, config=config, shard_names=shard_names, shard_sizes=shard_sizes)

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


@dataclass(frozen=True)
class WeightGroup:
    """Target tensors built from source tensors.

    `build` receives `{source name: tensor}` for every name in `sources` and returns `{target name: tensor}` for
    exactly the names in `targets`. A rename is a one-to-one group, a split a one-to-many group, a fusion of
    per-expert weights a many-to-one group.
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    build: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class IgnoreRule:
    """Source weights deliberately left out: names matching `pattern` (a regex matched at the start of the name)."""

    pattern: str
    reason: str

    def matches(self, name: str) -> bool:
        return re.match(self.pattern, name) is not None


def rename(source: str, target: str) -> WeightGroup:
    """The one-to-one group: the tensor `source` becomes `target` unchanged."""
    return WeightGroup((source,), (target,), lambda tensors: {target: tensors[source]})


def fuse_experts(source_prefix: str, target_prefix: str, num_experts: int) -> list[WeightGroup]:
    """Groups fusing per-expert SwiGLU weights (`{source_prefix}.{j}.gate_proj.weight`, `.up_proj`, `.down_proj`)
    into our `{target_prefix}.gate_up_proj [experts, 2 * inner, hidden]` and `{target_prefix}.down_proj
    [experts, hidden, inner]`: two groups, so that only one of them waits for its experts at a time."""
    gates = [f"{source_prefix}.{j}.gate_proj.weight" for j in range(num_experts)]
    ups = [f"{source_prefix}.{j}.up_proj.weight" for j in range(num_experts)]
    downs = [f"{source_prefix}.{j}.down_proj.weight" for j in range(num_experts)]
    gate_up, down = f"{target_prefix}.gate_up_proj", f"{target_prefix}.down_proj"
    return [
        WeightGroup(
            tuple(gates + ups), (gate_up,),
            lambda t: {gate_up: torch.stack([torch.cat([t[g], t[u]], dim=0) for g, u in zip(gates, ups)])},
        ),
        WeightGroup(tuple(downs), (down,), lambda t: {down: torch.stack([t[d] for d in downs])}),
    ]


@dataclass(frozen=True)
class ConcatenatedWeight:
    """One target tensor that is the concatenation along dim 0 of `sources` (in that order), e.g. an embedding table
    stored on disk in parts. It is streamed: each part is appended to the target's own output file as soon as it and
    the parts before it have arrived, so the whole tensor is never in memory."""

    sources: tuple[str, ...]
    target: str

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target,)


@dataclass
class ConversionPlan:
    """Every source weight's fate: built into our tensors by a group, or left out by an ignore rule."""

    groups: list[WeightGroup]
    ignore: list[IgnoreRule] = field(default_factory=list)
    concatenations: list[ConcatenatedWeight] = field(default_factory=list)

    @property
    def targets(self) -> list[str]:
        return [target for group in self.groups + self.concatenations for target in group.targets]

    def with_renamed_targets(self, rename_target: Callable[[str], str]) -> "ConversionPlan":
        """The same plan writing each target under `rename_target(name)` (e.g. our text model's weights moved under
        the multimodal model's `model.language_model.`)."""
        def renamed(group: WeightGroup) -> WeightGroup:
            build = group.build
            return WeightGroup(group.sources, tuple(map(rename_target, group.targets)),
                               lambda tensors: {rename_target(name): tensor for name, tensor in build(tensors).items()})

        return ConversionPlan(
            [renamed(group) for group in self.groups], list(self.ignore),
            [ConcatenatedWeight(c.sources, rename_target(c.target)) for c in self.concatenations],
        )

    def check(self, weight_names: Iterable[str]) -> dict[str, list[str]]:
        """Check the plan against the source's weight names; returns `{reason: names}` of what it leaves out.

        ConversionError for a source weight no group or rule covers ("unknown weight name"), for a weight a group
        needs that the source lacks, and for a source or target named by two groups.
        """
        weight_names = list(weight_names)
        needed, produced = {}, set()
        for group in self.groups + self.concatenations:
            for name in group.sources:
                if name in needed:
                    raise ConversionError(f"The plan reads source weight {name!r} in two groups; give it one.")
                needed[name] = group
            for name in group.targets:
                if name in produced:
                    raise ConversionError(f"The plan builds {name!r} in two groups; give it one.")
                produced.add(name)
        present = set(weight_names)
        lacking = [name for name in needed if name not in present]
        if lacking:
            raise ConversionError(
                f"The source lacks weight(s) the conversion needs: {_names_preview(lacking)} (for "
                f"{_names_preview(needed[lacking[0]].targets, 3)}); the checkpoint is incomplete or its config.json "
                "does not describe its weights."
            )
        ignored, unknown = {}, []
        for name in weight_names:
            if name in needed:
                continue
            rule = next((rule for rule in self.ignore if rule.matches(name)), None)
            if rule is None:
                unknown.append(name)
            else:
                ignored.setdefault(rule.reason, []).append(name)
        if unknown:
            raise ConversionError(
                f"Unknown weight name(s) in the source: {_names_preview(unknown)}; no part of the conversion reads "
                "them. The checkpoint holds weights this converter does not know (another variant of the "
                "architecture, or a modified checkpoint): converting would silently drop them."
            )
        return ignored


@dataclass
class ConversionReport:
    """What a conversion did and the memory it held."""

    output_dir: Path
    num_tensors: int
    num_output_shards: int
    output_bytes: int
    largest_source_shard_bytes: int
    max_held_bytes: int  # tensors held at once (an upper bound): current source shard + pending groups + output buffer
    peak_rss_bytes: int  # the process's resident peak during the conversion, as measured
    start_rss_bytes: int  # resident memory when the conversion started
    ignored: dict[str, list[str]]  # reason -> source names left out
    fresh: list[str]  # names of freshly initialised tensors

    def summary(self) -> str:
        """A few lines for the user: what was written, and peak memory against the largest source shard."""
        lines = [
            f"wrote {self.num_tensors} tensors ({format_bytes(self.output_bytes)}) in {self.num_output_shards} "
            f"shard(s) to {self.output_dir}",
            f"memory: tensors held at most {format_bytes(self.max_held_bytes)} = "
            f"{self.max_held_bytes / max(self.largest_source_shard_bytes, 1):.2f} x the largest source shard "
            f"({format_bytes(self.largest_source_shard_bytes)}); process peak RSS {format_bytes(self.peak_rss_bytes)} "
            f"(from {format_bytes(self.start_rss_bytes)} at the start)",
        ]
        if self.fresh:
            lines.append(f"freshly initialised {len(self.fresh)} tensors: {_names_preview(self.fresh, 3)}")
        return "\n".join(lines)


def format_bytes(size: int) -> str:
    """`1536` -> `"1.5 KiB"`."""
    units, index = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while size >= 1024 and index < len(units) - 1:
        size, index = size / 1024, index + 1
    return f"{size:.0f} B" if index == 0 else f"{size:.1f} {units[index]}"


class _InitialisedParts(HybridIndexPoolPreTrainedModel):
    """Holds some modules of our model so that `post_init` gives them the model's own `_init_weights`."""

    def __init__(self, config: HybridIndexPoolConfig, modules: list[nn.Module]):
        super().__init__(config)
        self.parts = nn.ModuleList(modules)
        self.post_init()


def fresh_weights(
    config: HybridIndexPoolConfig, modules: Mapping[str, Callable[[], nn.Module]], seed: int
) -> dict[str, torch.Tensor]:
    """Freshly initialised tensors for parts of our model that the source lacks.

    `modules` maps a prefix (`"model.layers.3.self_attn.indexer"`) to a factory of the module of ours that lives
    there; each is built on the CPU and initialised by our model's `_init_weights` (so e.g. learned pooling starts
    at the mean), deterministically for a given `seed`. Returns `{prefix.parameter: tensor}` in `config.dtype`.
    """
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # the caller's random state stays as it was
        torch.manual_seed(seed)
        holder = _InitialisedParts(config, [factory() for factory in modules.values()])
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
    return {
        f"{prefix}.{name}": tensor.detach().to(dtype)
        for prefix, module in zip(modules, holder.parts)
        for name, tensor in module.state_dict().items()
    }


def to_multimodal_name(name: str) -> str:
    """Where a weight of our causal LM lives in our multimodal model (its text model under `model.language_model.`)."""
    return name if name.startswith("lm_head.") else "model.language_model." + name.removeprefix("model.")


def target_model_class(config) -> type[HybridIndexPoolPreTrainedModel]:
    """The model a converted checkpoint of `config` holds: our causal LM, or the multimodal model for a
    multimodal config."""
    return HybridIndexPoolForConditionalGeneration if hasattr(config, "vision_config") else HybridIndexPoolForCausalLM


def expected_weights(config) -> tuple[dict[str, torch.Size], HybridIndexPoolPreTrainedModel]:
    """`{name: shape}` of what our model (causal LM or multimodal) stores for `config` (tied weights once), and that
    model on the meta device (no memory)."""
    with torch.device("meta"):
        model = target_model_class(config)(config)
    tied = set(model.all_tied_weights_keys)
    return {name: t.shape for name, t in model.state_dict().items() if name not in tied}, model


class _PeakRss:
    """The process's resident-memory peak over a stretch of code.

    Linux lets a process reset its peak (`5` into `/proc/self/clear_refs`), so the peak is the conversion's own;
    elsewhere it falls back to the lifetime peak of `getrusage`.
    """

    def __init__(self):
        self.resettable = True
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.resettable = False
        self.start = self._status("VmRSS") or 0

    @staticmethod
    def _status(field_name: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def peak(self) -> int:
        peak = self._status("VmHWM") if self.resettable else None
        return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _ConcatenationFile:
    """A safetensors file holding one tensor, written part by part along dim 0.

    The header (name, dtype, full shape) is written first from the parts' headers; each part's bytes follow in order
    (a row-major tensor concatenated along dim 0 is its parts' bytes one after another). Parts that arrive early wait.
    """

    def __init__(self, path: Path, concatenation: ConcatenatedWeight, headers: list[tuple[list[int], str]]):
        shapes, dtypes = [shape for shape, _ in headers], {dtype for _, dtype in headers}
        if len(dtypes) != 1 or any(len(shape) < 1 or shape[1:] != shapes[0][1:] for shape in shapes):
            raise ConversionError(
                f"The parts of {concatenation.target} ({_names_preview(concatenation.sources, 2)}) differ in dtype "
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


class _ShardWriter:
    """Buffers built tensors and writes them out as numbered shards of at most `max_shard_size` bytes (a single
    larger tensor gets a shard of its own)."""

    def __init__(self, folder: Path, max_shard_size: int):
        self.folder, self.max_shard_size = folder, max_shard_size
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # provisional file name, tensor names
        self.total_bytes = self.total_parameters = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor_bytes(tensor)
        if self.buffer and self.buffer_bytes + size > self.max_shard_size:
            self.flush()
        self.buffer[name] = tensor
        self.buffer_bytes += size
        self.total_bytes += size
        self.total_parameters += tensor.numel()

    def flush(self) -> None:
        if not self.buffer:
            return
        file_name = f"shard-{len(self.files) + 1:05d}.safetensors"
        save_file(self.buffer, self.folder / file_name, metadata={"format": "pt"})
        self.files.append((file_name, list(self.buffer)))
        self.buffer, self.buffer_bytes = {}, 0

    def add_concatenation(self, concatenation: ConcatenatedWeight, headers: list) -> _ConcatenationFile:
        """A file of its own for a streamed concatenation, numbered among the shards."""
        file_name = f"shard-{len(self.files) + 1:05d}.safetensors"
        stream = _ConcatenationFile(self.folder / file_name, concatenation, headers)
        self.files.append((file_name, [concatenation.target]))
        self.total_bytes += stream.nbytes
        self.total_parameters += math.prod(stream.shape)
        return stream

    def finish(self) -> dict[str, str]:
        """Flush, give the shards their final names (as `save_pretrained` names them) and write the index."""
        self.flush()
        if len(self.files) == 1:
            (self.folder / self.files[0][0]).rename(self.folder / SINGLE_FILE)
            return {name: SINGLE_FILE for name in self.files[0][1]}
        weight_map = {}
        for number, (file_name, names) in enumerate(self.files, start=1):
            final = f"model-{number:05d}-of-{len(self.files):05d}.safetensors"
            (self.folder / file_name).rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {
            "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return weight_map


def _own_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns its memory: a view (a split's piece) would keep its whole source alive, and
    safetensors refuses tensors that share memory."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor_bytes(tensor):
        tensor = tensor.clone()
    return tensor


# For text, the position streams of the Qwen multimodal RoPE are equal, which makes it plain RoPE.
MULTIMODAL_ROPE_KEYS = ("mrope_section", "mrope_interleaved")


def qwen_hybrid_settings(full_config, text_config, multimodal_rope: bool = False) -> dict:
    """Our config fields that every Qwen hybrid (Qwen3-Next, Qwen3.5, Qwen4-Exp) maps the same way: widths, gated
    attention with partial RoPE (multimodal-RoPE sections dropped unless `multimodal_rope`), Gated DeltaNet, norms,
    special tokens, dtype. `full_config` is the checkpoint's config, `text_config` its text part (the same object
    for text checkpoints)."""
    text = text_config
    rope = {key: value for key, value in text.rope_parameters.items()
            if multimodal_rope or key not in MULTIMODAL_ROPE_KEYS}
    return dict(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
        rope_parameters=rope,
        attention_output_gate=True,
        attention_bias=text.attention_bias,
        attention_dropout=text.attention_dropout,
        linear_num_key_heads=text.linear_num_key_heads,
        linear_num_value_heads=text.linear_num_value_heads,
        linear_key_head_dim=text.linear_key_head_dim,
        linear_value_head_dim=text.linear_value_head_dim,
        linear_conv_kernel_dim=text.linear_conv_kernel_dim,
        hidden_act=text.hidden_act,
        rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings,
        initializer_range=text.initializer_range,
        tie_word_embeddings=bool(full_config.tie_word_embeddings),
        pad_token_id=text.pad_token_id,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        dtype=full_config.dtype or text.dtype,
    )


def qwen_source_configs(source: SourceCheckpoint, multimodal: bool):
    """A Qwen source's full config, read by transformers (which fills defaults and old field names), and its text
    part (the same object for a text-only checkpoint)."""
    full = AutoConfig.from_pretrained(source.folder)
    return full, (full.get_text_config() if multimodal else full)


def qwen_text_prefix(multimodal: bool) -> str:
    """Where a Qwen checkpoint keeps its text model's weights."""
    return "model.language_model." if multimodal else "model."


def qwen_outer_plan(config: HybridIndexPoolConfig, multimodal: bool, keep_vision: bool = False) -> ConversionPlan:
    """The part of a Qwen hybrid's plan outside the layers: the embedding, the head (or its tie), and what is left
    out (an MTP head, a multimodal checkpoint's vision tower unless `keep_vision`)."""
    groups = [rename(f"{qwen_text_prefix(multimodal)}embed_tokens.weight", "model.embed_tokens.weight")]
    ignore = [IgnoreRule(r"mtp\.", "multi-token-prediction head: our model has none")]
    if multimodal and not keep_vision:
        ignore.append(IgnoreRule(r"model\.visual\.", "vision tower: the converted model reads text only"))
    if config.tie_word_embeddings:
        ignore.append(IgnoreRule(r"lm_head\.weight$", "tied to the input embeddings"))
    else:
        groups.append(rename("lm_head.weight", "lm_head.weight"))
    return ConversionPlan(groups, ignore)


def qwen_attention_parts(config: HybridIndexPoolConfig) -> list[str]:
    """Gated attention weights named alike in every Qwen hybrid and in ours (relative to the layer)."""
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    parts = [f"self_attn.{name}.weight" for name in projections + ("q_norm", "k_norm")]
    if config.attention_bias:
        parts += [f"self_attn.{name}.bias" for name in projections]
    return parts


def qwen_moe_plan(src: str, dst: str, config: HybridIndexPoolConfig, weight_names) -> tuple[list[str], list]:
    """A Qwen MoE block: the parts renamed as they are (router, shared expert) and the groups that fuse per-expert
    weights (none when the experts are already fused on disk, in our layout)."""
    parts, groups = ["mlp.gate.weight"], []
    if config.shared_expert_intermediate_size:
        parts += [f"mlp.shared_expert.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")]
        parts += ["mlp.shared_expert_gate.weight"]
    if f"{src}mlp.experts.gate_up_proj" in weight_names:
        parts += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    else:
        groups = fuse_experts(f"{src}mlp.experts", f"{dst}mlp.experts", config.num_experts)
    return parts, groups


def convert_checkpoint(
    source: SourceCheckpoint,
    plan: ConversionPlan,
    config: HybridIndexPoolConfig,
    output_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    extra_tensors: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> ConversionReport:
    """Convert `source` into a self-contained checkpoint of ours in `output_dir`, streaming shard by shard.

    Before any tensor is read: the output folder is checked (refused if it exists, unless `overwrite`), the plan is
    checked against the source's weight names ([`ConversionPlan.check`]) and the plan's targets plus `extra_tensors`
    (freshly initialised weights, a mapping or a callable returning one) against what our model expects for
    `config`. Then each source shard is loaded alone, its tensors handed to their groups, and each group built as
    soon as all its sources have arrived; built tensors go to output shards of at most `max_shard_size`. Every
    tensor's shape is checked as it is built, and the set of written names and shapes at the end.

    The result is written into a temporary folder next to `output_dir` and renamed at the end; on any exception
    (KeyboardInterrupt included, and SIGTERM or SIGHUP, which raise `Terminated`) the temporary folder is removed and
    an existing `output_dir` is left untouched.
    The folder gets `config.json` (with `auto_map`), the sharded safetensors, the flat remote code, a model card,
    and the source's tokenizer files and `generation_config.json`, like `save_pretrained` writes them.
    """
    output_dir = Path(output_dir)
    if output_dir.exists():
        if not overwrite:
            raise ConversionError(
                f"Output folder {output_dir} already exists; choose another or pass overwrite=True (--overwrite) "
                "to replace it once the conversion has succeeded."
            )
        if not output_dir.is_dir():
            raise ConversionError(f"Output path {output_dir} exists and is not a folder; remove it or choose another.")
        if output_dir.resolve() == source.folder.resolve():
            raise ConversionError(f"Output folder {output_dir} is the source folder; write the conversion elsewhere.")
    max_shard_size = convert_file_size_to_int(max_shard_size)

    ignored = plan.check(source.weight_names)
    for reason, names in ignored.items():
        log(f"leaving out {len(names)} source weights ({reason}): {_names_preview(names, 3)}")
    expected, meta_model = expected_weights(config)
    extra = dict(extra_tensors() if callable(extra_tensors) else (extra_tensors or {}))
    both = set(plan.targets) & set(extra)
    if both:
        raise ConversionError(f"Both the plan and `extra_tensors` produce {_names_preview(both)}; "
                              "give each one source.")
    planned = plan.targets + list(extra)
    missing, unexpected = set(expected) - set(planned), set(planned) - set(expected)
    if missing or unexpected:
        raise ConversionError(
            "The conversion does not produce exactly the weights our model expects for this config: "
            + (f"missing {_names_preview(missing)}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"not in our model {_names_preview(unexpected)}" if unexpected else "")
            + ". The source config and the plan disagree: check the config mapping of the converter."
        )

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # Named before it exists and created under the signal handler, so that a SIGTERM at any moment finds it removable.
    work_dir = output_dir.parent / f".{output_dir.name}.converting-{uuid.uuid4().hex[:12]}"
    rss = _PeakRss()
    streams: list[_ConcatenationFile] = []
    with _terminate_as_exception():
        try:
            work_dir.mkdir()
            return _convert_into(source, plan, config, output_dir, work_dir, streams, expected, meta_model, extra,
                                 max_shard_size, ignored, progress, rss)
        except BaseException:
            for stream in streams:
                stream.handle.close()
            shutil.rmtree(work_dir, ignore_errors=True)
            raise


def _convert_into(source, plan, config, output_dir, work_dir, streams, expected, meta_model, extra, max_shard_size,
                  ignored, progress, rss) -> "ConversionReport":
    """The streaming conversion of `convert_checkpoint` into `work_dir`, renamed to `output_dir` at the end."""
    writer = _ShardWriter(work_dir, max_shard_size)
    # Bytes held at most: the current shard's unconsumed tensors + sources of groups still waiting (or being
    # built) + built tensors not yet buffered + the output buffer. A renamed tensor counts twice while it moves
    # from its group to the buffer, so this is an upper bound.
    max_held = 0

    def emit(name: str, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ConversionError(
                f"Built {name} with shape {tuple(tensor.shape)}, but our model expects {tuple(expected[name])} "
                "for this config; the source's config.json does not match its weights."
            )
        writer.add(name, _own_tensor(tensor))

    fresh = list(extra)
    for name in fresh:
        emit(name, extra.pop(name))  # the writer holds it now
        max_held = max(max_held, writer.buffer_bytes)

    part_of = {}  # source name -> (its streamed concatenation, part index)
    for concatenation in plan.concatenations:
        headers = [source.tensor_header(name) for name in concatenation.sources]
        stream = writer.add_concatenation(concatenation, headers)
        if tuple(stream.shape) != tuple(expected[concatenation.target]):
            raise ConversionError(
                f"The parts of {concatenation.target} add up to shape {tuple(stream.shape)}, but our model expects "
                f"{tuple(expected[concatenation.target])}; the source's config.json does not match its weights."
            )
        streams.append(stream)
        part_of.update({name: (stream, index) for index, name in enumerate(concatenation.sources)})

    group_of = {name: group for group in plan.groups for name in group.sources}
    arrived: dict[int, dict[str, torch.Tensor]] = {}  # id(group) -> sources so far
    pending_bytes = 0
    shards = source.shards()
    for shard in tqdm(shards, desc="Converting shards", unit="shard", disable=not progress):
        tensors = source.load_shard(shard)
        shard_bytes = sum(tensor_bytes(t) for t in tensors.values())
        waiting_bytes = sum(stream.waiting_bytes for stream in streams)
        max_held = max(max_held, shard_bytes + pending_bytes + waiting_bytes + writer.buffer_bytes)
        for name in list(tensors):
            tensor = tensors.pop(name)
            shard_bytes -= tensor_bytes(tensor)
            if name in part_of:
                stream, index = part_of[name]
                stream.add(index, tensor)
                waiting_bytes = sum(stream.waiting_bytes for stream in streams)
                max_held = max(max_held, shard_bytes + pending_bytes + waiting_bytes + writer.buffer_bytes)
                continue
            group = group_of.get(name)
            if group is None:
                continue  # left out by an ignore rule
            sources = arrived.setdefault(id(group), {})
            sources[name] = tensor
            pending_bytes += tensor_bytes(tensor)
            if len(sources) < len(group.sources):
                continue
            built = group.build(sources)
            if set(built) != set(group.targets):
                raise ConversionError(
                    f"The group reading {_names_preview(group.sources, 2)} built {sorted(built)} instead of "
                    f"{sorted(group.targets)}; fix the converter's plan."
                )
            built_bytes = sum(tensor_bytes(t) for t in built.values())
            for target in group.targets:
                emit(target, built[target])
                built_bytes -= tensor_bytes(built[target])
                max_held = max(max_held, shard_bytes + pending_bytes + built_bytes + writer.buffer_bytes)
            pending_bytes -= sum(tensor_bytes(t) for t in sources.values())
            del arrived[id(group)], sources, built
        del tensors
    unfinished = [stream for stream in streams if stream.next_part < len(stream.part_bytes)]
    if unfinished:
        raise ConversionError(f"Parts of {unfinished[0].shape} never arrived; the source shards are inconsistent.")
    weight_map = writer.finish()

    written = {}
    for file_name in dict.fromkeys(weight_map.values()):
        with safe_open(work_dir / file_name, framework="pt") as handle:
            written.update({name: torch.Size(handle.get_slice(name).get_shape()) for name in handle.keys()})
    if written != expected:
        wrong = sorted(name for name in set(written) & set(expected) if written[name] != expected[name])
        raise ConversionError(
            "The written checkpoint does not match our model: "
            f"missing {_names_preview(set(expected) - set(written))}; "
            f"not in our model {_names_preview(set(written) - set(expected))}; wrong shapes {_names_preview(wrong)}."
        )
    _write_metadata(source, config, meta_model, work_dir)
    peak_rss = rss.peak()
    _replace(work_dir, output_dir)
    return ConversionReport(
        output_dir=output_dir, num_tensors=len(written), num_output_shards=len(writer.files),
        output_bytes=writer.total_bytes, largest_source_shard_bytes=max(source.shard_sizes.values()),
        max_held_bytes=max_held, peak_rss_bytes=peak_rss, start_rss_bytes=rss.start, ignored=ignored,
        fresh=fresh,
    )


def _write_metadata(source: SourceCheckpoint, config: HybridIndexPoolConfig, meta_model, folder: Path) -> None:
    """Everything but the weights: config with `auto_map`, remote code, card, generation config, tokenizer."""
    # As `save_pretrained` of our model would set them.
    config.architectures = [target_model_class(config).__name__]
    config.auto_map = auto_map_for(config)
    config.save_pretrained(folder)
    write_remote_code(folder, multimodal=hasattr(config, "vision_config"))
    write_model_card(meta_model, folder)
    for file_name in COPIED_FILES:
        if (source.folder / file_name).is_file():
            shutil.copyfile(source.folder / file_name, folder / file_name)
    if not (folder / "generation_config.json").exists():
        GenerationConfig.from_model_config(config).save_pretrained(folder)


def _replace(work_dir: Path, output_dir: Path) -> None:
    """Move the finished `work_dir` to `output_dir`, replacing an existing folder only now that all succeeded."""
    if not output_dir.exists():
        work_dir.rename(output_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.replaced-", dir=output_dir.parent))
    old.rmdir()
    output_dir.rename(old)
    try:
        work_dir.rename(output_dir)
    except BaseException:
        old.rename(output_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def conversion_argument_parser(description: str, source_help: str) -> argparse.ArgumentParser:
    """A converter's command line with the arguments every converter shares: `--source`, `--output`, `--overwrite`,
    `--max_shard_size` and `--no_progress`; the converter adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help=source_help)
    parser.add_argument("--output", required=True, help="folder to write (must not exist unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output once the conversion succeeded")
    parser.add_argument("--max_shard_size", default="5GB", help="largest output shard (default 5GB)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    return parser


def run_conversion_command(parser: argparse.ArgumentParser, convert: Callable[[], "ConversionReport"]):
    """Run a converter from its command line: print the report, or exit with status 2 and the refusal's message."""
    try:
        report = convert()
    except ConversionError as error:
        parser.exit(2, f"error: {error}\n")
    except Terminated as stop:
        parser.exit(128 + signal.SIGTERM, f"{stop}: the partial output was removed\n")
    print(report.summary())
    return report


__all__ = [
    "CONVERTER_SCRIPTS",
    "ConcatenatedWeight",
    "ConversionError",
    "ConversionPlan",
    "ConversionReport",
    "IgnoreRule",
    "SourceCheckpoint",
    "Terminated",
    "WeightGroup",
    "conversion_argument_parser",
    "convert_checkpoint",
    "expected_weights",
    "fresh_weights",
    "fuse_experts",
    "qwen_attention_parts",
    "qwen_hybrid_settings",
    "qwen_moe_plan",
    "qwen_outer_plan",
    "qwen_source_configs",
    "qwen_text_prefix",
    "rename",
    "run_conversion_command",
    "to_multimodal_name",
]
