"""Self-contained checkpoints: flat remote code that loads without the package, the folder's contents, the card."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_factory import KIMI_DELTA, tiny_model

from hybrid_indexpool.modeling import hub_export
from hybrid_indexpool.tokenization import byte_level_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LOAD_WITHOUT_PACKAGE = r'''
import importlib.abc, json, sys
blocked = set(sys.argv[3].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is not installed here")

sys.meta_path.insert(0, Block())
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
for name in blocked:
    try:
        __import__(name)
        raise SystemExit(f"{name} should not be importable")
    except ImportError:
        pass
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert not type(model).__module__.startswith("hybrid_indexpool"), type(model).__module__
input_ids = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(input_ids).logits
    tokens = model.generate(input_ids, max_new_tokens=8, do_sample=False)
classifier = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], trust_remote_code=True)
torch.save({"logits": logits, "tokens": tokens, "classifier": type(classifier).__name__}, sys.argv[2] + ".out")
'''


def save_checkpoint(tmp_path, **overrides):
    model = tiny_model(**overrides)
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize(
    "blocked, overrides",
    [("hybrid_indexpool", {}), ("hybrid_indexpool,triton", {}), ("hybrid_indexpool,fla", KIMI_DELTA)],
    ids=["package", "package_triton", "kimi_delta"],
)
def test_loads_through_auto_classes_where_the_package_is_not_importable(tmp_path, blocked, overrides):
    model, folder = save_checkpoint(tmp_path, **overrides)
    input_ids = torch.randint(1, 97, (2, 30))
    torch.save(input_ids, tmp_path / "input.pt")
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_PACKAGE, str(folder), str(tmp_path / "input.pt"), blocked],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(tmp_path / "input.pt.out")
    with torch.no_grad():
        torch.testing.assert_close(remote["logits"], model(input_ids).logits, atol=0, rtol=0)
        assert torch.equal(remote["tokens"], model.generate(input_ids, max_new_tokens=8, do_sample=False))
    assert remote["classifier"] == "HybridIndexPoolForSequenceClassification"


def test_saved_folder_holds_everything_for_the_hub_and_nothing_from_the_machine(tmp_path):
    model, folder = save_checkpoint(tmp_path)
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json",
            "tokenizer_config.json", "configuration_hybrid_indexpool.py", "modeling_hybrid_indexpool.py"} <= names
    config = json.loads((folder / "config.json").read_text())
    for target in config["auto_map"].values():
        assert (folder / (target.split(".")[0] + ".py")).exists()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and (folder / f"{node.module}.py").exists(), (path.name, node.module)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(name.startswith("hybrid_indexpool") for name in names), path.name
    for path in folder.iterdir():
        if path.suffix in (".json", ".py", ".md"):
            text = path.read_text()
            assert str(tmp_path) not in text and "/work/" not in text and "/root/" not in text, path.name


def test_remote_code_is_generated_from_the_package_sources():
    files = hub_export.generate_remote_code()
    assert {"configuration_hybrid_indexpool.py", "modeling_hybrid_indexpool.py", "cache_hybrid_indexpool.py",
            "kernels_sparse_attention.py", "kernels_sparse_attention_reference.py", "linear_attention_kda.py",
            "kernels_kimi_delta_rule.py", "kernels_kimi_delta_rule_reference.py", "decoder_layer.py",
            "multi_token_prediction.py"} <= set(files)
    package_source = Path(hub_export.__file__).with_name("token_layout.py").read_text()
    assert files["token_layout.py"].endswith(package_source)  # no relative import: the source as it is
    assert "from .cache_layers import LinearAttentionLayerCache" in files["delta_rule.py"]
    assert "from .cache_layers import IndexPoolLayerCache" in files["cache_hybrid_indexpool.py"]
    assert "from .kernels_pooled_index_topk import pooled_index_scores_torch, pooled_index_topk" in \
        files["attention_indexpool.py"]
    assert "from .attention_gqa import HybridIndexPoolAttention" in files["decoder_layer.py"]
    assert "from .decoder_layer import HybridIndexPoolMTPDecoderLayer" in files["multi_token_prediction.py"]
    assert "from .kernels_kimi_delta_rule import kimi_delta_rule" in files["linear_attention_kda.py"]
    assert "from .attention_mla import HybridIndexPoolMLAAttention" in files["decoder_layer.py"]


def test_model_card_describes_the_checkpoint_and_a_users_card_is_kept(tmp_path):
    model, folder = save_checkpoint(tmp_path)
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers")
    assert "| token budget (`index_topk`) | 8 |" in card and "| pool size (`index_pool_size`) | 4 |" in card
    assert f"| parameters | {model.num_parameters():,} |" in card and "`L`, `L`, `L`, `I`" in card
    (folder / "README.md").write_text("my own card")
    model.save_pretrained(folder)
    assert (folder / "README.md").read_text() == "my own card"


def test_a_model_loaded_as_remote_code_saves_a_loadable_checkpoint_again(tmp_path):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    model, folder = save_checkpoint(tmp_path)
    # The flat class from the checkpoint (with the package installed, the Auto classes prefer the package's).
    remote_class = get_class_from_dynamic_module("modeling_hybrid_indexpool.HybridIndexPoolForCausalLM", folder)
    assert not remote_class.__module__.startswith("hybrid_indexpool")
    again = tmp_path / "again"
    remote_class.from_pretrained(folder).save_pretrained(again)
    assert {p.name for p in folder.glob("*.py")} == {p.name for p in again.glob("*.py")}
    for path in folder.glob("*.py"):
        assert (again / path.name).read_text() == path.read_text()
    reloaded = get_class_from_dynamic_module("modeling_hybrid_indexpool.HybridIndexPoolForCausalLM", again)
    reloaded = reloaded.from_pretrained(again)
    input_ids = torch.randint(1, 97, (1, 20))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, model(input_ids).logits)


LOAD_BESIDE_THE_PACKAGE = r'''
import logging, sys
import torch
from transformers import AutoModelForCausalLM
logging.basicConfig(level=logging.WARNING)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert not type(model).__module__.startswith("hybrid_indexpool"), type(model).__module__
assert "hybrid_indexpool" not in sys.modules, "finding the C sources must not import the package"
with torch.no_grad():
    model.generate(torch.randint(1, 97, (1, 8)), max_new_tokens=3, do_sample=False)
kernels = {module.KERNEL.name: module.KERNEL for name, module in sys.modules.items()
           if name.endswith("_cpu_impl") and hasattr(module, "KERNEL")}
# The decode's products and selection run (the paged attention's kernel is imported, for the vLLM plugin, not run).
used = [kernels["linear_rows"], kernels["pooled_topk_windows"]]
assert all(kernel.is_loaded for kernel in used), [kernel.error for kernel in used]
'''


def test_remote_code_beside_the_installed_package_builds_its_cpu_kernels(tmp_path):
    _, folder = save_checkpoint(tmp_path)
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "HYBRID_INDEXPOOL_CACHE": str(tmp_path / "kernels")}
    result = subprocess.run([sys.executable, "-c", LOAD_BESIDE_THE_PACKAGE, str(folder)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "could not be built" not in result.stderr and "pip install" not in result.stderr, result.stderr[-3000:]
