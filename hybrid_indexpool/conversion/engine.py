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

import contextlib
import os
import re
import resource
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub.serialization import get_torch_storage_size
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.utils.hub import convert_file_size_to_int

from ..configuration import HybridIndexPoolConfig
from ..modeling import (
    HybridIndexPoolForCausalLM,
    HybridIndexPoolForConditionalGeneration,
    HybridIndexPoolPreTrainedModel,
)
from ..modeling.hub_export import auto_map_for, write_model_card, write_remote_code
from .checkpoint_io import ConcatenationFile, ShardWriter, SourceCheckpoint, tensor_bytes
from .errors import ConversionError, names_preview

# Copied verbatim from the source folder when present: the tokenizer and the generation defaults.
COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    # A multimodal checkpoint's processor: AutoProcessor.from_pretrained(output) reads them.
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)


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



@dataclass(frozen=True)
class WeightGroup:
    """Target tensors built from source tensors.

    `build` receives `{source name: tensor}` for every name in `sources` and returns `{target name: tensor}` for
    exactly the names in `targets`. A rename is a one-to-one group, a split a one-to-many group, a fusion of
    per-expert weights a many-to-one group. `inverse`, where given, undoes `build` exactly (`{target name: tensor}`
    -> `{source name: tensor}`): the export back to the source's format runs it ([`ConversionPlan.inverted`]).
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    build: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    inverse: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None


@dataclass(frozen=True)
class IgnoreRule:
    """Source weights deliberately left out: names matching `pattern` (a regex matched at the start of the name)."""

    pattern: str
    reason: str

    def matches(self, name: str) -> bool:
        return re.match(self.pattern, name) is not None


def count_mtp_layers(layer_indices: Iterable[int], first: int, declared: int | None, declared_field: str) -> int:
    """How many multi-token-prediction layers a source holds, from the indices (`first` on) its MTP weights name:
    ConversionError unless they follow on from `first` without gaps and match the config's `declared_field` when it
    declares one."""
    found = sorted(set(layer_indices))
    if found != list(range(first, first + len(found))):
        raise ConversionError(f"The source's multi-token-prediction layers are {found}; they count from {first} "
                              "without gaps.")
    if declared is not None and declared != len(found):
        raise ConversionError(f"The source config declares {declared_field} = {declared}, but its weights hold "
                              f"{len(found)} multi-token-prediction layers; the checkpoint is incomplete or its "
                              "config.json does not describe it.")
    return len(found)


def rename(source: str, target: str) -> WeightGroup:
    """The one-to-one group: the tensor `source` becomes `target` unchanged."""
    return WeightGroup((source,), (target,), lambda tensors: {target: tensors[source]},
                       lambda tensors: {source: tensors[target]})


def concatenated(sources: tuple[str, ...], target: str) -> WeightGroup:
    """Source tensors of equal first dimension concatenated along dim 0 into one of ours (e.g. per-part
    convolutions); the inverse splits it back into equal parts."""
    return WeightGroup(
        sources, (target,), lambda tensors: {target: torch.cat([tensors[name] for name in sources])},
        lambda tensors: dict(zip(sources, (part.clone() for part in tensors[target].chunk(len(sources))))),
    )


def fuse_experts(source_prefix: str, target_prefix: str, num_experts: int) -> list[WeightGroup]:
    """Groups fusing per-expert SwiGLU weights (`{source_prefix}.{j}.gate_proj.weight`, `.up_proj`, `.down_proj`)
    into our `{target_prefix}.gate_up_proj [experts, 2 * inner, hidden]` and `{target_prefix}.down_proj
    [experts, hidden, inner]`: two groups, so that only one of them waits for its experts at a time."""
    gates = [f"{source_prefix}.{j}.gate_proj.weight" for j in range(num_experts)]
    ups = [f"{source_prefix}.{j}.up_proj.weight" for j in range(num_experts)]
    downs = [f"{source_prefix}.{j}.down_proj.weight" for j in range(num_experts)]
    gate_up, down = f"{target_prefix}.gate_up_proj", f"{target_prefix}.down_proj"

    def split_gate_up(tensors):
        halves = [expert.chunk(2) for expert in tensors[gate_up]]
        return {**{g: half[0].clone() for g, half in zip(gates, halves)},
                **{u: half[1].clone() for u, half in zip(ups, halves)}}

    return [
        WeightGroup(
            tuple(gates + ups), (gate_up,),
            lambda t: {gate_up: torch.stack([torch.cat([t[g], t[u]], dim=0) for g, u in zip(gates, ups)])},
            split_gate_up,
        ),
        WeightGroup(tuple(downs), (down,), lambda t: {down: torch.stack([t[d] for d in downs])},
                    lambda t: {d: expert.clone() for d, expert in zip(downs, t[down])}),
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
            build, inverse = group.build, group.inverse
            return WeightGroup(
                group.sources, tuple(map(rename_target, group.targets)),
                lambda tensors: {rename_target(name): tensor for name, tensor in build(tensors).items()},
                None if inverse is None else lambda tensors: inverse(
                    {name: tensors[rename_target(name)] for name in group.targets}),
            )

        return ConversionPlan(
            [renamed(group) for group in self.groups], list(self.ignore),
            [ConcatenatedWeight(c.sources, rename_target(c.target)) for c in self.concatenations],
        )

    def inverted(self, source_shapes: Mapping[str, torch.Size]) -> "ConversionPlan":
        """The plan back: each group's `inverse` building its sources from its targets, each concatenation split
        into its parts (of `source_shapes`). ConversionError names a group that cannot be undone."""
        groups = []
        for group in self.groups:
            if group.inverse is None:
                raise ConversionError(f"The part of the conversion that builds {names_preview(group.targets, 2)} "
                                      "cannot be undone; the export does not support it.")
            groups.append(WeightGroup(group.targets, group.sources, group.inverse, group.build))
        for concatenation in self.concatenations:
            sizes = [source_shapes[name][0] for name in concatenation.sources]
            groups.append(WeightGroup(
                concatenation.targets, concatenation.sources,
                lambda tensors, c=concatenation, sizes=sizes: dict(zip(
                    c.sources, (part.clone() for part in tensors[c.target].split(sizes)))),
            ))
        return ConversionPlan(groups)

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
                f"The source lacks weight(s) the conversion needs: {names_preview(lacking)} (for "
                f"{names_preview(needed[lacking[0]].targets, 3)}); the checkpoint is incomplete or its config.json "
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
                f"Unknown weight name(s) in the source: {names_preview(unknown)}; no part of the conversion reads "
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
            lines.append(f"freshly initialised {len(self.fresh)} tensors: {names_preview(self.fresh, 3)}")
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


@dataclass(frozen=True)
class CheckpointTarget:
    """What a conversion writes: the weights the target model stores (`{name: shape}`) and everything but the
    weights (`write_metadata(folder)`: config, code, tokenizer, ...). By default our model; the export to a source
    format gives that format's."""

    expected: Mapping[str, torch.Size]
    write_metadata: Callable[[Path], None]


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



def _own_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns its memory: a view (a split's piece) would keep its whole source alive, and
    safetensors refuses tensors that share memory."""
    tensor = tensor.contiguous()
    if get_torch_storage_size(tensor) != tensor_bytes(tensor):
        tensor = tensor.clone()
    return tensor



def shard_size_bytes(max_shard_size: int | str) -> int:
    """`max_shard_size` in bytes: an int, a string of digits, or a size with a unit as transformers reads it ("5GB",
    "500MB", "2GiB"). ConversionError naming the value unless it is a positive size."""
    text = str(max_shard_size).strip()
    try:
        size = int(text) if text.isdigit() else convert_file_size_to_int(text)
    except ValueError:
        size = None
    if size is None or size <= 0:
        raise ConversionError(
            f"max_shard_size {max_shard_size!r} (--max_shard_size) is not a positive size; give a number of bytes or "
            "a size with a unit, such as 5GB or 500MB."
        )
    return size


def convert_checkpoint(
    source: SourceCheckpoint,
    plan: ConversionPlan,
    config: HybridIndexPoolConfig,
    output_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    extra_tensors: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]] | None = None,
    computed_tensors: Mapping[str, torch.Tensor] | None = None,
    target: CheckpointTarget | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> ConversionReport:
    """Convert `source` into a self-contained checkpoint of ours in `output_dir`, streaming shard by shard.

    Before any tensor is read: the output folder is checked (refused if it exists, unless `overwrite`), the plan is
    checked against the source's weight names ([`ConversionPlan.check`]) and the plan's targets plus `extra_tensors`
    (freshly initialised weights, a mapping or a callable returning one; the report lists them) and
    `computed_tensors` (values the target stores and the config determines, such as hashing tables: written, not
    reported as initialised) against what our model expects for `config`. Then each source shard is loaded alone,
    its tensors handed to their groups, and each group built as soon as all its sources have arrived; built tensors
    go to output shards of at most `max_shard_size`. Every tensor's shape is checked as it is built, and the set of
    written names and shapes at the end.

    The result is written into a temporary folder next to `output_dir` and renamed at the end; on any exception
    (KeyboardInterrupt included, and SIGTERM or SIGHUP, which raise `Terminated`) the temporary folder is removed and
    an existing `output_dir` is left untouched.
    The folder gets `config.json` (with `auto_map`), the sharded safetensors, the flat remote code, a model card,
    and the source's tokenizer files and `generation_config.json`, like `save_pretrained` writes them; with a
    `target`, its weights and its `write_metadata` instead.
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
    max_shard_size = shard_size_bytes(max_shard_size)

    ignored = plan.check(source.weight_names)
    for reason, names in ignored.items():
        log(f"leaving out {len(names)} source weights ({reason}): {names_preview(names, 3)}")
    if target is None:
        expected, meta_model = expected_weights(config)
        target = CheckpointTarget(expected, lambda folder: _write_metadata(source, config, meta_model, folder))
    expected = dict(target.expected)
    extra = dict(extra_tensors() if callable(extra_tensors) else (extra_tensors or {}))
    fresh, computed = list(extra), dict(computed_tensors or {})
    both = set(extra) & set(computed)
    if both:
        raise ConversionError(f"Both `extra_tensors` and `computed_tensors` produce {names_preview(both)}; "
                              "give each one source.")
    extra.update(computed)
    both = set(plan.targets) & set(extra)
    if both:
        raise ConversionError(f"Both the plan and `extra_tensors` produce {names_preview(both)}; "
                              "give each one source.")
    planned = plan.targets + list(extra)
    missing, unexpected = set(expected) - set(planned), set(planned) - set(expected)
    if missing or unexpected:
        raise ConversionError(
            "The conversion does not produce exactly the weights the target model expects for this config: "
            + (f"missing {names_preview(missing)}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"not in the target model {names_preview(unexpected)}" if unexpected else "")
            + ". The source config and the plan disagree: check the config mapping of the converter."
        )

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # Named before it exists and created under the signal handler, so that a SIGTERM at any moment finds it removable.
    work_dir = output_dir.parent / f".{output_dir.name}.converting-{uuid.uuid4().hex[:12]}"
    rss = _PeakRss()
    streams: list[ConcatenationFile] = []
    with _terminate_as_exception():
        try:
            work_dir.mkdir()
            return _convert_into(source, plan, output_dir, work_dir, streams, expected, target.write_metadata, extra,
                                 fresh, max_shard_size, ignored, progress, rss)
        except BaseException:
            for stream in streams:
                stream.handle.close()
            shutil.rmtree(work_dir, ignore_errors=True)
            raise


def _convert_into(source, plan, output_dir, work_dir, streams, expected, write_metadata, extra, fresh, max_shard_size,
                  ignored, progress, rss) -> "ConversionReport":
    """The streaming conversion of `convert_checkpoint` into `work_dir`, renamed to `output_dir` at the end; `extra`
    are the tensors written up front, `fresh` the names among them the report lists as freshly initialised."""
    writer = ShardWriter(work_dir, max_shard_size)
    # Bytes held at most: the current shard's unconsumed tensors + sources of groups still waiting (or being
    # built) + built tensors not yet buffered + the output buffer. A renamed tensor counts twice while it moves
    # from its group to the buffer, so this is an upper bound.
    max_held = 0

    def emit(name: str, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ConversionError(
                f"Built {name} with shape {tuple(tensor.shape)}, but the target model expects {tuple(expected[name])} "
                "for this config; the source's config.json does not match its weights."
            )
        writer.add(name, _own_tensor(tensor))

    for name in list(extra):
        emit(name, extra.pop(name))  # the writer holds it now
        max_held = max(max_held, writer.buffer_bytes)

    part_of = {}  # source name -> (its streamed concatenation, part index)
    for concatenation in plan.concatenations:
        headers = [source.tensor_header(name) for name in concatenation.sources]
        stream = writer.add_concatenation(concatenation, headers)
        if tuple(stream.shape) != tuple(expected[concatenation.target]):
            raise ConversionError(
                f"The parts of {concatenation.target} add up to shape {tuple(stream.shape)}, but the target model "
                f"expects {tuple(expected[concatenation.target])}; the source's config.json does not match its weights."
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
                    f"The group reading {names_preview(group.sources, 2)} built {sorted(built)} instead of "
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
            "The written checkpoint does not match the target model: "
            f"missing {names_preview(set(expected) - set(written))}; "
            f"not in the target model {names_preview(set(written) - set(expected))}; wrong shapes "
            f"{names_preview(wrong)}."
        )
    write_metadata(work_dir)
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


