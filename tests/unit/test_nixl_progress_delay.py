"""The NIXL progress-thread pause (kv_transfer/nixl.py): a 0 delay becomes the configured one."""
from __future__ import annotations

import pytest

from kv_transfer.nixl import install_progress_delay


def test_zero_progress_delay_is_replaced_and_others_are_kept() -> None:
    nixl_api = pytest.importorskip("nixl._api")
    assert install_progress_delay(1000) is True
    assert install_progress_delay(1000) is True  # idempotent
    cfg = nixl_api.nixlBind.nixlAgentConfig()
    cfg.pthrDelay = 0  # what nixl's nixl_agent sets
    assert cfg.pthrDelay == 1000
    cfg.pthrDelay = 7
    assert cfg.pthrDelay == 7
