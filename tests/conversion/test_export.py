"""The export's building blocks: plans run backwards, and the weights a family's checkpoint holds on disk."""

import pytest
import torch
from checkpoint_files import saved_tensors
from qwen_sources import tiny_qwen4_source

from hybrid_indexpool.conversion import (
    ConcatenatedWeight,
    ConversionError,
    ConversionPlan,
    WeightGroup,
    concatenated,
    fuse_experts,
    rename,
)
from hybrid_indexpool.conversion.export import saved_weight_shapes


def test_a_plan_run_backwards_gives_back_its_sources_exactly():
    torch.manual_seed(0)
    sources = {"a": torch.randn(3, 2), **{f"part.{i}": torch.randn(2, 2) for i in range(3)},
               **{f"e.{j}.{name}.weight": torch.randn(4, 2) for j in range(2)
                  for name in ("gate_proj", "up_proj", "down_proj")},
               "table.0": torch.randn(5, 2), "table.1": torch.randn(1, 2)}
    plan = ConversionPlan([rename("a", "b"), concatenated(("part.0", "part.1", "part.2"), "parts"),
                           *fuse_experts("e", "experts", 2)],
                          concatenations=[ConcatenatedWeight(("table.0", "table.1"), "table")])
    built = {}
    for group in plan.groups:
        built.update(group.build({name: sources[name] for name in group.sources}))
    built["table"] = torch.cat([sources["table.0"], sources["table.1"]])
    back = {}
    for group in plan.inverted({name: tensor.shape for name, tensor in sources.items()}).groups:
        back.update(group.build({name: built[name] for name in group.sources}))
    assert sorted(back) == sorted(sources) and all(torch.equal(back[name], sources[name]) for name in sources)


def test_a_group_without_an_inverse_is_refused_by_name():
    plan = ConversionPlan([WeightGroup(("x",), ("y",), lambda tensors: {"y": tensors["x"] * 2})])
    with pytest.raises(ConversionError, match="builds y cannot be undone"):
        plan.inverted({})


def test_the_weights_on_disk_are_known_without_saving_or_allocating(tmp_path):
    model = tiny_qwen4_source()
    model.save_pretrained(tmp_path)
    shapes = saved_weight_shapes(type(model), model.config)
    saved = saved_tensors(tmp_path)
    assert sorted(shapes) == sorted(saved) and all(shapes[name] == saved[name].shape for name in saved)
