"""What a user who installed the wheel gets: run with that environment's Python, from outside the checkout.

Imports the installed package (from site-packages, every module there, no generic top-level module names), builds
the CPU kernels from the shipped C sources, builds a tiny model and generates, then saves it and loads it back
through the checkpoint's remote code in a process where `hybrid_indexpool` cannot be imported, with the same logits.
"""

import importlib
import importlib.metadata
import importlib.util
import os
import pkgutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

import hybrid_indexpool
from hybrid_indexpool import HybridIndexPoolCache, HybridIndexPoolConfig, HybridIndexPoolForCausalLM
from hybrid_indexpool.kernels.decode_linear import cpu_impl as linear_impl
from hybrid_indexpool.kernels.pooled_index_topk import cpu_impl as topk_impl

SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"]).resolve()

# Loads the saved folder with the package hidden, and prints the logits' checksum.
LOAD_AS_REMOTE_CODE = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hybrid_indexpool":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
with torch.no_grad():
    logits = model(torch.load(sys.argv[2])).logits
torch.save(logits, sys.argv[3])
"""


def check_installed_modules() -> None:
    package_folder = Path(hybrid_indexpool.__file__).resolve().parent
    assert package_folder.is_relative_to(SITE_PACKAGES), f"hybrid_indexpool imported from {package_folder}"
    modules = [info.name for info in pkgutil.walk_packages(hybrid_indexpool.__path__, "hybrid_indexpool.")]
    without_triton = importlib.util.find_spec("triton") is None
    without_vllm = importlib.util.find_spec("vllm") is None
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            if without_triton and name.rpartition(".")[2].startswith("triton_"):  # the Triton kernels need the extra
                continue
            if without_vllm and name.startswith("hybrid_indexpool.serving."):  # the vLLM plugin's model needs vLLM
                continue
            raise
    # Read from the wheel's own record: another distribution may own a generic name (transformers needs the
    # PyPI package `kernels`), and the check is about what this wheel puts in site-packages.
    installed_top_level = {Path(file).parts[0] for file in importlib.metadata.distribution("hybrid-indexpool").files}
    generic_names = installed_top_level & {"modeling", "configuration", "kernels", "scripts", "serving", "tests"}
    assert not generic_names, f"the wheel installed top-level modules called {sorted(generic_names)}"
    print(f"imported {len(modules)} modules from {package_folder}")


def check_cpu_kernels() -> None:
    for kernel in (linear_impl.KERNEL, topk_impl.KERNEL):
        assert kernel.load() is not None, f"{kernel.name}: {kernel.error}"
        assert kernel.source.is_file() and kernel.source.resolve().is_relative_to(SITE_PACKAGES)
    print("CPU kernels built from the installed C sources")


def check_generate_save_and_remote_load(folder: Path) -> None:
    torch.manual_seed(0)
    config = HybridIndexPoolConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=8, index_pool_size=4,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        eos_token_id=None, pad_token_id=0)
    model = HybridIndexPoolForCausalLM(config).eval()
    prompt = torch.randint(1, 128, (2, 40))
    output = model.generate(prompt, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert output.sequences.shape == (2, 48) and isinstance(output.cache, HybridIndexPoolCache)
    print("generated", output.sequences[:, 40:].tolist())
    print("cache bytes", output.cache.memory_footprint())

    model.save_pretrained(folder / "checkpoint")
    torch.save(prompt, folder / "prompt.pt")
    environment = dict(os.environ, HF_MODULES_CACHE=str(folder / "modules"), HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", LOAD_AS_REMOTE_CODE, str(folder / "checkpoint"), str(folder / "prompt.pt"),
                    str(folder / "logits.pt")], check=True, env=environment)
    with torch.no_grad():
        expected = model(prompt).logits
    torch.testing.assert_close(torch.load(folder / "logits.pt"), expected, atol=1e-5, rtol=1e-5)
    print("saved, loaded through remote code without the package: same logits")


def main() -> None:
    check_installed_modules()
    check_cpu_kernels()
    with tempfile.TemporaryDirectory() as folder:
        check_generate_save_and_remote_load(Path(folder))
    print("smoke test passed")


if __name__ == "__main__":
    main()
