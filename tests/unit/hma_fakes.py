"""Fake KV connectors that vLLM's MultiConnector can load by module path ("hma_fakes"), one that
declares SupportsHMA and one that does not; each records the scheduler-side calls it gets."""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

CALLS: list[tuple[str, str, Any]] = []  # (connector name, method, argument of interest)


class _Recording(KVConnectorBase_V1):
    tokens = 0  # what get_num_new_matched_tokens offers
    finished: tuple[bool, dict[str, Any] | None] = (False, None)
    divergent = False

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.name = vllm_config.kv_transfer_config.kv_connector

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.divergent

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        CALLS.append((self.name, "matched", num_computed_tokens))
        return self.tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        CALLS.append((self.name, "alloc", num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        CALLS.append((self.name, "finished", block_ids))
        return self.finished

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return


class FakeHMAConnector(_Recording, SupportsHMA):
    """Stands in for the NIXL producer: holds every group's blocks for a reader, restores lagging state."""

    tokens = 0
    finished = (True, {"do_remote_prefill": True, "remote_block_ids": [[1, 2], [7]]})
    divergent = True

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        CALLS.append((self.name, "finished_all_groups", block_ids))
        return self.finished


class FakePlainConnector(_Recording):
    """A connector that does not declare HMA (one KV cache group only)."""
