"""Connecting to Ray: an embedded local cluster on 127.0.0.1, or an existing one."""

from __future__ import annotations

import logging
import os
from typing import Any

from mindpulse.config import RunConfig
from mindpulse.node.agent import WORKER_ENV

log = logging.getLogger(__name__)


class RaySession:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.embedded = not cfg.ray.address
        self.address = ""
        self.temp_dir = ""

    def __enter__(self) -> RaySession:
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs: dict[str, Any] = dict(
            namespace=self.cfg.ray.namespace,
            logging_level=logging.WARNING,
            log_to_driver=False,
            runtime_env={"env_vars": dict(WORKER_ENV)},
        )
        if self.embedded:
            # one CPU slot per rank plus headroom for agents; bound to loopback only; a temp
            # dir of its own so this run's Ray processes can be told from anyone else's
            import uuid

            self.temp_dir = f"/tmp/mindpulse-ray-{uuid.uuid4().hex[:8]}"
            kwargs.update(
                num_cpus=self.cfg.world.world_size + 1,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                _temp_dir=self.temp_dir,
            )
            ctx = ray.init(**kwargs)
        else:
            ctx = ray.init(address=self.cfg.ray.address, **kwargs)
        self.address = getattr(ctx, "address_info", {}).get("address", "") or ray.get_runtime_context().gcs_address
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.temp_dir:
            import shutil

            shutil.rmtree(self.temp_dir, ignore_errors=True)
