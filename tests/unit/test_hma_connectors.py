"""Baton's connector stack and vLLM's hybrid memory allocator (HMA, docs/hybrid_pd.md): every
connector Baton configures declares SupportsHMA (so vLLM keeps the hybrid KV cache manager a
hybrid model needs), the kv_transfer_config Baton emits is one vLLM itself judges HMA-capable,
the segment connector turns itself off on a KV cache that is not one full-attention group, vLLM's
MultiConnector hands the per-group block ids to every child, and the checkpoint scheduler never
reports a divergent hybrid hit. vLLM's own classes, no engine."""
from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import hma_fakes
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA, supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

from baton.engine.args import build_engine_spec
from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.checkpoints.depth import PrefixDepthTracker
from baton.engine.checkpoints.policy import CheckpointPolicy
from baton.engine.checkpoints.scheduler import CheckpointScheduler
from baton.engine.config import EngineConfig
from kv_transfer.config import NIXL_ENGINE_ENV, kv_transfer_engine_arg, stack_supports_hma
from kv_transfer.segment_connector import SegmentConnector
from kv_transfer.segment_meta import PARAMS_KEY
from kv_transfer.segment_scheduler import kv_cache_blocker
from kv_transfer.segments import KVSegment, process_segments

BS, HEADS, DIM = 4, 2, 8


def attention(*layers: int) -> KVCacheGroupSpec:
    return KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in layers],
                            FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32))


def conv(*layers: int) -> KVCacheGroupSpec:
    return KVCacheGroupSpec([f"model.layers.{i}.conv" for i in layers],
                            MambaSpec(block_size=BS, shapes=((16, 3),), dtypes=(torch.float32,)))


def kv_cache(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=list(groups))


LFM2_LIKE = kv_cache(attention(2, 5), conv(0, 1, 3, 4))  # tiny-lfm2: conv, conv, attn, conv, conv, attn


def vllm_config(kv_transfer: dict[str, Any] | None = None, *, hma: bool = True) -> Any:
    hf = SimpleNamespace(rope_theta=10000.0, head_dim=DIM, hidden_size=HEADS * DIM, num_attention_heads=HEADS)
    ktc = KVTransferConfig(**(kv_transfer or {"kv_connector": "SegmentConnector", "kv_connector_module_path": "kv_transfer.segment_connector",
                                              "kv_role": "kv_both"}))
    return SimpleNamespace(
        kv_transfer_config=ktc,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not hma),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(dtype=torch.float32, hf_config=hf, max_model_len=64),
    )


# ---- what each connector declares, and what vLLM concludes from the config Baton emits ---------------------


def test_every_baton_connector_declares_hma() -> None:
    from kv_transfer.nixl import CountingNixlConnector  # builds the NixlConnector subclass (imports vLLM's NIXL)

    assert issubclass(SegmentConnector, SupportsHMA) and supports_hma(SegmentConnector)
    assert issubclass(CountingNixlConnector, SupportsHMA)
    assert CountingNixlConnector.request_finished_all_groups is not SupportsHMA.request_finished_all_groups
    assert issubclass(MultiConnector, SupportsHMA)  # vLLM's: supports HMA iff every child does (all_children_support_hma)


@pytest.mark.parametrize(("role", "handoff", "segments"), [
    (r, h, s) for r, h, s in itertools.product(("prefill", "decode"), (True, False), (True, False)) if h or s])
def test_vllm_keeps_hma_on_for_every_kv_transfer_config_baton_emits(role: Any, handoff: bool, segments: bool) -> None:
    arg = kv_transfer_engine_arg(role, handoff=handoff, on_gpu=False, segments=segments)
    assert arg is not None
    assert KVConnectorFactory.supports_hma_config(KVTransferConfig(**arg)) is True  # no "Turning off hybrid kv cache manager"
    assert stack_supports_hma(arg) is True


def test_baton_mirror_of_vllms_hma_rule_agrees_when_a_child_lacks_hma() -> None:
    nixl = kv_transfer_engine_arg("decode", handoff=True, on_gpu=False)
    plain = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [nixl, plain]}}
    for cfg in (plain, multi):
        assert KVConnectorFactory.supports_hma_config(KVTransferConfig(**cfg)) is False
        assert stack_supports_hma(cfg) is False
    assert stack_supports_hma(None) is True


def test_handoff_engines_get_the_ds_conv_state_layout_nixl_needs_for_hybrid_state() -> None:
    cfg = EngineConfig(model="tiny-lfm2", checkpoints=CheckpointConfig())
    for role in ("prefill", "decode"):
        for on_gpu in (False, True):
            spec = build_engine_spec(cfg, role=role, handoff=True, model_path="/m", on_gpu=on_gpu, cache_root="/c")
            assert spec.env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS" == NIXL_ENGINE_ENV["VLLM_SSM_CONV_STATE_LAYOUT"]
            assert spec.engine_kwargs["kv_transfer_config"]["kv_connector"] == "CountingNixlConnector"
    colocated = build_engine_spec(cfg, role="decode", handoff=False, model_path="/m", on_gpu=False, cache_root="/c")
    assert "VLLM_SSM_CONV_STATE_LAYOUT" not in colocated.env  # no NIXL: vLLM's platform default stays


# ---- the segment connector on KV cache groups -----------------------------------------------------------


def test_segments_fit_only_one_full_attention_group() -> None:
    assert kv_cache_blocker(None) is None
    assert kv_cache_blocker(kv_cache(attention(0, 1))) is None
    assert "recurrent" in (kv_cache_blocker(LFM2_LIKE) or "")
    swa = KVCacheGroupSpec(["model.layers.1.self_attn.attn"],
                           SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32, sliding_window=8))
    assert "2 KV cache groups" in (kv_cache_blocker(kv_cache(attention(0), swa)) or "")
    assert "not full attention" in (kv_cache_blocker(kv_cache(swa)) or "")


def test_on_a_hybrid_model_injection_is_recomputed_and_capture_fails_at_once_with_why() -> None:
    sched = SegmentConnector(vllm_config(), KVConnectorRole.SCHEDULER, LFM2_LIKE)
    SegmentConnector(vllm_config(), KVConnectorRole.WORKER, LFM2_LIKE)  # the worker half starts too
    assert "recurrent" in (sched.scheduler_side.disabled or "")
    table = process_segments()
    g = torch.Generator().manual_seed(0)
    table.offer("h1", (KVSegment((1, 2, 3), torch.randn(2, 3, HEADS, DIM, generator=g), torch.randn(2, 3, HEADS, DIM, generator=g)),))
    try:
        r = SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3, 4, 5],
                            kv_transfer_params={PARAMS_KEY: {"key": "h1", "inject_end": 3}})
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        c = SimpleNamespace(request_id="c", prompt_token_ids=[1, 2, 3, 4, 5],
                            kv_transfer_params={PARAMS_KEY: {"key": "h2", "capture": [[0, 3]]}})
        sched.update_state_after_alloc(c, SimpleNamespace(get_block_ids=lambda: ([0, 1], [5])), 0)
        result = table.take_capture("h2")
        assert result is not None and result.segments == () and "recurrent" in (result.error or "")
        # HMA ends a request with every group's blocks; nothing is held, nothing stays behind
        assert sched.request_finished_all_groups(c, ([0, 1], [5])) == (False, None)
        assert sched.scheduler_side.in_flight == 0
    finally:
        for key in ("h1", "h2"):
            table.discard(key)


# ---- vLLM's MultiConnector over HMA children ------------------------------------------------------------

FAKE_HMA = {"kv_connector": "FakeHMAConnector", "kv_connector_module_path": "hma_fakes", "kv_role": "kv_both"}
FAKE_PLAIN = {"kv_connector": "FakePlainConnector", "kv_connector_module_path": "hma_fakes", "kv_role": "kv_both"}
SEGMENTS = {"kv_connector": "SegmentConnector", "kv_connector_module_path": "kv_transfer.segment_connector", "kv_role": "kv_both"}


def multi(*children: dict[str, Any], hma: bool = True) -> MultiConnector:
    cfg = vllm_config({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"connectors": [copy.deepcopy(c) for c in children]}}, hma=hma)
    return MultiConnector(cfg, KVConnectorRole.SCHEDULER, LFM2_LIKE)


def test_multiconnector_hands_every_groups_block_ids_to_each_hma_child() -> None:
    hma_fakes.CALLS.clear()
    mc = multi(FAKE_HMA, SEGMENTS)
    r = SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3], kv_transfer_params={})
    assert mc.get_num_new_matched_tokens(r, 0) == (0, False)
    mc.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([1, 2], [7])), 0)
    delay, params = mc.request_finished_all_groups(r, ([1, 2], [7]))
    assert delay is True and params == {"do_remote_prefill": True, "remote_block_ids": [[1, 2], [7]]}
    assert ("FakeHMAConnector", "finished_all_groups", ([1, 2], [7])) in hma_fakes.CALLS
    assert not [c for c in hma_fakes.CALLS if c[1] == "finished"]  # the single-group path is not taken
    # the segment child restores no recurrent state, so the stack reports no divergent hybrid hits
    assert mc.supports_divergent_local_hybrid_hits is False


def test_multiconnector_with_a_child_without_hma_refuses_hma() -> None:
    with pytest.raises(AssertionError, match="HMA should not be enabled"):
        multi(FAKE_HMA, FAKE_PLAIN, hma=True)
    hma_fakes.CALLS.clear()
    mc = multi(FAKE_HMA, FAKE_PLAIN, hma=False)  # vLLM turned HMA off: one group, the old path
    r = SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3], kv_transfer_params={})
    mc.request_finished_all_groups(r, ([4, 5],))
    assert [c[1] for c in hma_fakes.CALLS] == ["finished", "finished"]


# ---- the checkpoint scheduler never takes vLLM's divergent-hit path -------------------------------------


def test_checkpoint_scheduler_reports_the_agreed_hit_and_no_junction_even_with_a_divergent_connector() -> None:
    class Manager:
        def get_computed_blocks(self, request: Any) -> tuple[str, int, int]:
            return "agreed", 256, 512  # vLLM would pin a junction at 512

        def get_computed_blocks_for_connector(self, request: Any) -> Any:
            raise AssertionError("the divergent lookup must not be used with checkpoints")

    s = object.__new__(CheckpointScheduler)
    s.connector = SimpleNamespace(supports_divergent_local_hybrid_hits=True)  # NIXL
    s.kv_cache_manager = Manager()
    s.ckpt_block = s.hash_block_size = 128
    s.checkpoint_policy = CheckpointPolicy(CheckpointConfig(), 128)
    s._depths = PrefixDepthTracker(128)
    s._clock = lambda: 0.0
    s._observed = OrderedDict()
    req = SimpleNamespace(request_id="r", block_hashes=[b"a", b"b", b"c"], num_prompt_tokens=400)
    assert s._get_local_prefix_cache_hit(req) == ("agreed", 256, 0, False)  # diverged False: vLLM never re-runs the lookup
    assert s.checkpoint_policy.counters.requests == 1
