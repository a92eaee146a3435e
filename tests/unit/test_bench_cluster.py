"""LocalServeApp fails fast: a config the builder refuses never launches, and a deploy failure
in the `serve run` log ends the wait at once (no engine, no Ray)."""
from __future__ import annotations

from pathlib import Path

import pytest

from baton.bench.cluster import LocalServeApp, deploy_failure
from deployments.config import ConfigError

LOG = """\
\x1b[36m(ServeController pid=11628)\x1b[0m ERROR 2026-12-02 01:23:43,675 controller 11628 -- Deploying app 'baton' failed with exception:
\x1b[36m(ServeController pid=11628)\x1b[0m Traceback (most recent call last):
\x1b[36m(ServeController pid=11628)\x1b[0m deployments.config.ConfigError: invalid Baton config:
\x1b[36m(ServeController pid=11628)\x1b[0m   <root>: Value error, give it at least one replica
"""


def test_deploy_failure_names_the_builders_error(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_text("INFO starting\n" + LOG)
    assert deploy_failure(log) == "deployments.config.ConfigError: invalid Baton config: <root>: Value error, give it at least one replica"


def test_no_failure_while_the_log_has_none(tmp_path: Path) -> None:
    assert deploy_failure(tmp_path / "missing.log") is None
    log = tmp_path / "serve.log"
    log.write_text("INFO Deploying app 'baton'\nINFO Application 'baton' is ready\n")
    assert deploy_failure(log) is None


def test_a_refused_config_never_launches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = {"model": "SmolLM2-135M-Instruct"}
    app = LocalServeApp({"prefill": {"num_replicas": 0, "engine": engine}, "decode": {"num_replicas": 1, "engine": engine}},
                        resources={}, log_dir=tmp_path)
    launched = []
    monkeypatch.setattr(app, "_launch", lambda host: launched.append(host))
    with pytest.raises(ConfigError, match="prefills on the prefill pool"):
        app.__enter__()
    assert launched == []
