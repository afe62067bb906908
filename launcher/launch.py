"""`mindpulse launch`: run directory → Ray → aggregator → scheduler → ranks → supervise.

The supervision loop runs `while not status.is_terminal()`: it prints the aggregator's
tables, watches every rank's result, turns Ctrl-C/SIGTERM/SIGHUP into a stop of every
rank after the same step (a second signal kills), and on the first rank failure stops
the others at once so no rank is left blocked in a collective.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from .config import RunConfig
from .progress import ProgressLine
from .rundir import make_run_dir, write_config, write_json
from .ray_session import WORKER_ENV, RaySession
from .config import Backend
from .failures import VICTIM
from .preflight import LaunchRefused
from .spec import ExitCode, RankOutcome, RunResult, RunStatus, free_port, node_devices, rank_specs

log = logging.getLogger(__name__)

SCHED_EXIT_WAIT_S = 40.0


class Launch:
    def __init__(self, cfg: RunConfig, config_path: Path | None, out=sys.stdout,
                 resume: dict[str, Any] | None = None):
        self.cfg = cfg
        self.resume = resume
        self.config_path = config_path
        self.out = out
        self.run_dir = make_run_dir(cfg)
        self.run_id = f"{self.run_dir.name}-{uuid.uuid4().hex[:6]}"
        self.signals = 0
        self.started = time.time()
        self.actors: list[Any] = []
        self.agents: list[Any] = []
        self.failure_order: list[int] = []
        self.aggregator = None
        self.pids: dict[str, Any] = {}
        self.progress = ProgressLine(out)

    # ---- helpers -------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.progress.clear()
        print(text, file=self.out, flush=True)

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1

    def _resolve_paths(self) -> None:
        """Relative paths in the config are resolved against the config file's folder."""
        base = self.config_path.parent if self.config_path else Path.cwd()
        job = self.cfg.job
        if job.script:
            p = Path(job.script)
            if not p.is_absolute():
                p = (base / p) if (base / p).exists() else (Path.cwd() / p)
            job.script = str(p.resolve())
        if job.recipe and job.recipe.init_from:
            p = Path(job.recipe.init_from)
            if not p.is_absolute():
                for cand in (base / p, Path.cwd() / p, Path(__file__).resolve().parent.parent / p):
                    if cand.exists():
                        p = cand
                        break
            job.recipe.init_from = str(p.resolve())

    def total_steps(self) -> int | None:
        if self.cfg.train.steps:
            return self.cfg.train.steps
        return None

    # ---- the run -------------------------------------------------------------------------
    def run(self) -> int:
        self._resolve_paths()
        from .preflight import check_local

        try:
            check_local(self.cfg)
        except LaunchRefused as exc:
            print(f"mindpulse: {exc}", file=sys.stderr, flush=True)
            import shutil

            shutil.rmtree(self.run_dir, ignore_errors=True)
            return int(ExitCode.USAGE)
        write_config(self.run_dir, self.cfg)
        self.say(f"mindpulse: run directory {self.run_dir}")
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        result = RunResult(status=RunStatus.FAILED, message="launcher did not start")
        snapshot: dict[str, Any] = {}
        try:
            with RaySession(self.cfg) as session:
                self.session = session
                self.pids["ray_temp_dir"] = session.temp_dir
                # Ray's core installs its own SIGTERM handler at init: ours must come after
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(sig, self._on_signal)
                result, snapshot = self._run_attempts()
        except LaunchRefused as exc:
            for s, h in old.items():
                signal.signal(s, h)
            print(f"mindpulse: {exc}", file=sys.stderr, flush=True)
            import shutil

            shutil.rmtree(self.run_dir, ignore_errors=True)  # nothing ran: leave nothing behind
            return int(ExitCode.USAGE)
        except Exception as exc:
            log.exception("launcher failed")
            result = RunResult(status=RunStatus.FAILED, message=f"launcher error: {type(exc).__name__}: {exc}")
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        status = self._write_summary(result, snapshot)
        return int(ExitCode.of(status))

    def _run_attempts(self) -> tuple[RunResult, dict[str, Any]]:
        """Attempt 0, then up to `max_restarts` relaunches of every rank from the newest
        valid checkpoint after a failure. Injected faults fire in attempt 0 only (so a
        rehearsal of recovery can succeed); each attempt's logs are kept apart."""
        from mindpulse.workers.checkpoint import choose_resume

        self.attempts: list[dict[str, Any]] = []
        for k in range(self.cfg.max_restarts + 1):
            self.attempt = k
            self.logs_dir = self.run_dir / "logs" if k == 0 else self.run_dir / "logs" / f"attempt_{k}"
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            try:
                result, snapshot = self._run_in_ray()
            except LaunchRefused as exc:
                if k == 0:
                    raise
                # a later attempt cannot be placed (a node is gone): the run has a history; keep it
                result = RunResult(status=RunStatus.FAILED, message=f"restart refused: {exc}")
                snapshot = {}
            except Exception as exc:
                log.exception("attempt %d failed in the launcher", k)
                self._kill_ranks()
                self._terminate(graceful=False)
                result = RunResult(status=RunStatus.FAILED,
                                   message=f"launcher error: {type(exc).__name__}: {exc}")
                snapshot = {}
            record = {"attempt": k, "status": result.status.value, "message": result.message,
                      "resumed_from": self.resume, "logs": str(self.logs_dir),
                      "steps_completed": snapshot.get("steps_completed", 0)}
            if result.status is RunStatus.FAILED:
                from .failures import FailureKind, describe_failure

                last = {x["rank"]: x["last_step"] for x in snapshot.get("ranks", [])}
                record["failure"] = describe_failure(result.outcomes, result.order, self.logs_dir, last,
                                                     FailureKind.HANG if result.hang else FailureKind.CRASH,
                                                     stuck=result.hang, message=result.message)
            self.attempts.append(record)
            if result.status is not RunStatus.FAILED or k == self.cfg.max_restarts or self.signals:
                return result, snapshot
            entry, refused = choose_resume(self.run_dir / "checkpoints", "latest") \
                if (self.run_dir / "checkpoints" / "manifest.json").exists() else (None, [])
            for line in refused:
                self.say(f"mindpulse: {line}")
            if entry is not None:
                self.resume = {"path": str(self.run_dir / "checkpoints" / entry.path), "step": entry.step,
                               "epoch": entry.epoch, "kind": entry.kind}
            self.say(f"mindpulse: attempt {k} failed ({result.message}); restarting every rank "
                     f"(attempt {k + 1} of {self.cfg.max_restarts + 1}) from "
                     + (f"step {self.resume['step']} ({self.resume['path']})" if self.resume else "the start"))
        return result, snapshot

    def _run_in_ray(self) -> tuple[RunResult, dict[str, Any]]:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from mindpulse.aggregator.actor import actor_name, start_aggregator
        from mindpulse.workers.rank_actor import RankActor

        from .node_agent import NodeAgent
        from .preflight import check_cluster

        cfg = self.cfg
        w = cfg.world
        world = w.world_size
        check_cluster(cfg, ray.cluster_resources(), [n for n in ray.nodes() if n.get("Alive")])

        plain = cfg.to_dict()
        settings = {"anomalies": plain["anomalies"], "checkpoint": plain["checkpoint"], "eval": plain["eval"],
                    "tensorboard": cfg.output.tensorboard, "monitor": plain["monitor"],
                    "config_yaml": (self.run_dir / "config.yaml").read_text()}
        self.actors, self.agents, self.failure_order = [], [], []
        attempt = getattr(self, "attempt", 0)
        logs_dir = getattr(self, "logs_dir", self.run_dir / "logs")
        self.aggregator = start_aggregator(self.run_id + (f"-a{attempt}" if attempt else ""), cfg.ray.namespace, self.run_dir, world,
                                           cfg.monitor.per_print_step, self.total_steps(),
                                           node_id=ray.get_runtime_context().get_node_id(), settings=settings)
        self.pids["aggregator"] = ray.get(self.aggregator.ping.remote(), timeout=60)
        write_json(self.run_dir / "pids.json", self.pids)  # for operators (and tests) while it runs

        # one bundle per node holding that node's ranks; STRICT_SPREAD puts nodes apart
        key = {"cpu": "CPU", "ascend": "NPU", "gpu": "GPU"}[w.device.value]
        bundles = [{key: float(w.ranks_per_node)} for _ in range(w.nodes)]
        pg = placement_group(bundles, strategy="PACK" if w.nodes == 1 else "STRICT_SPREAD")
        try:
            ray.get(pg.ready(), timeout=120)
        except Exception as exc:
            raise LaunchRefused(f"the Ray cluster cannot place {w.nodes} node(s) x {w.ranks_per_node} {key}: {exc}")
        self.pg = pg
        bundle_nodes = placement_group_table(pg).get("bundles_to_node_id", {})
        devices = node_devices(cfg)

        self.agents = []
        for n in range(w.nodes):
            self.agents.append(ray.remote(NodeAgent).options(
                num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=n),
                runtime_env={"env_vars": dict(WORKER_ENV)}, max_restarts=0,
                # threaded: run_msrun holds one thread for the whole job; kill_ranks, stop,
                # dump_stacks and telemetry must still get through
                max_concurrency=8,
            ).remote(n, self.aggregator, w.device.value,
                     {n * w.ranks_per_node + i: devices[i] for i in range(w.ranks_per_node)},
                     cfg.monitor.telemetry_interval_s, w.ranks_per_node, cfg.monitor.decision_timeout_s))
        self.agent_infos = ray.get([a.info.remote() for a in self.agents], timeout=120)
        node0 = self.agent_infos[0]
        sched_host = "127.0.0.1" if (self.session.embedded or w.nodes == 1 and node0["ip"] == ray.util.get_node_ip_address()) \
            else (cfg.msrun.master_addr or node0["ip"])
        sched_port = cfg.msrun.master_port or free_port("127.0.0.1" if sched_host == "127.0.0.1" else "")
        run_env = self._run_env()
        if attempt:
            run_env["MINDPULSE_FAULTS"] = ""  # faults are a rehearsal of the first attempt
            run_env["MINDPULSE_AGGREGATOR"] = actor_name(self.run_id + f"-a{attempt}")
        specs = rank_specs(cfg, sched_host, sched_port, run_env, run_dir=str(self.run_dir))
        for spec in specs:
            spec.command = [f"--log_dir={logs_dir}" if c.startswith("--log_dir=") else c for c in spec.command]
        for spec in specs:
            spec.env["MINDPULSE_RELAY"] = self.agent_infos[spec.node]["relay"]
            spec.env["MINDPULSE_NODE_RANK"] = str(spec.node)
        job = cfg.to_dict()
        job["resume"] = self.resume
        write_json(self.run_dir / "job.json", job)
        write_json(self.run_dir / "plan.json", [s.to_dict() for s in specs])
        self.pids["agents"] = {i["node"]: i["pid"] for i in self.agent_infos}

        if cfg.backend is Backend.MSRUN:
            refs = self._start_msrun(specs, sched_host, sched_port)
        else:
            refs = self._start_rank_actors(specs, sched_host, sched_port, job, RankActor,
                                           PlacementGroupSchedulingStrategy, pg, key)
        result = self._supervise(refs)
        dropped = 0
        for a in self.agents:  # final telemetry sample, relay flushed
            try:
                dropped += ray.get(a.stop.remote(kill=result.status is RunStatus.FAILED), timeout=20).get("dropped", 0)
            except Exception:
                pass
        self.dropped_packets = getattr(self, "dropped_packets", 0) + dropped
        snapshot: dict[str, Any] = {}
        try:
            self._poll(final=True)
            snapshot = ray.get(self.aggregator.close.remote(), timeout=30)
        except Exception as exc:
            self.say(f"mindpulse: WARNING the aggregator did not answer at the end ({exc}); the ranks' own "
                     "results stand, the cluster metrics are incomplete (metrics.msgpack has what it accepted)")
            self.aggregator_lost = True
        self._terminate(graceful=result.status is not RunStatus.FAILED and self.signals < 2)
        try:
            ray.kill(self.aggregator, no_restart=True)  # closed: its state is in summary and metrics
        except Exception:
            pass
        try:
            remove_placement_group(pg)
        except Exception:
            pass
        return result, snapshot

    def _run_env(self) -> dict[str, str]:
        cfg = self.cfg
        from mindpulse.aggregator.actor import actor_name

        return {
            "MINDPULSE_RUN_ID": self.run_id,
            "MINDPULSE_NAMESPACE": cfg.ray.namespace,
            "MINDPULSE_AGGREGATOR": actor_name(self.run_id),
            "MINDPULSE_RAY_ADDRESS": self.session.address,
            "MINDPULSE_COLLECT_FREQ": str(cfg.monitor.collect_freq),
            "MINDPULSE_DECISION_EVERY": str(cfg.monitor.decision_every),
            "MINDPULSE_DECISION_TIMEOUT_S": str(cfg.monitor.decision_timeout_s),
            "MINDPULSE_TOTAL_STEPS": str(cfg.train.steps),
            "MINDPULSE_BATCH_SIZE": str(cfg.train.batch_size),
            "MINDPULSE_RUN_DIR": str(self.run_dir),
            "MINDPULSE_FAULTS": ",".join(cfg.faults),
            "MINDPULSE_EVAL_EVERY": str(cfg.eval.every_steps),
            "MINDPULSE_EVAL_PER_EPOCH": "1" if cfg.eval.per_epoch else "0",
            "MINDPULSE_SAVE_STEPS": str(cfg.checkpoint.save_checkpoint_steps),
            "MINDPULSE_KEEP_CKPT": str(cfg.checkpoint.keep_checkpoint_max),
            "MINDPULSE_KEEP_BEST": str(cfg.checkpoint.keep_best_max),
            "MINDPULSE_CKPT_FORMAT": cfg.checkpoint.format.value,
            "MINDPULSE_RESUME_CKPT": (self.resume or {}).get("path", ""),
            "MINDPULSE_RESUME_STEP": str((self.resume or {}).get("step", 0)),
            "MINDPULSE_HANG_TIMEOUT_S": str(cfg.monitor.hang_timeout_s),
            "MINDPULSE_WEIGHT_STATS": "1" if cfg.monitor.weight_stats else "0",
            **({"MINDPULSE_HIST_REGEX": cfg.monitor.histogram_regex} if cfg.monitor.histogram_regex else {}),
            "MINDPULSE_PROFILE_STEPS": ",".join(map(str, cfg.profile.steps)),
            "MINDPULSE_PROFILE_RANKS": ",".join(map(str, cfg.profile.ranks)),
            "GLOG_v": os.environ.get("GLOG_v", "2"),
        }

    def _start_rank_actors(self, specs, sched_host, sched_port, job, RankActor, PGStrategy, pg, key) -> dict:
        import ray

        cfg = self.cfg
        self.pids["scheduler"] = ray.get(self.agents[0].start_scheduler.remote(
            sched_host, sched_port, cfg.world.world_size, str(self.logs_dir / "scheduler.log"),
            cfg.world.device.device_target, dict(cfg.env)), timeout=60)
        for spec in specs:
            opts: dict[str, Any] = dict(
                num_cpus=1 if key == "CPU" else 0,
                resources={} if key == "CPU" else {key: 1},
                scheduling_strategy=PGStrategy(pg, placement_group_bundle_index=spec.node),
                runtime_env={"env_vars": dict(WORKER_ENV, **spec.env)},
                max_restarts=0,
                name=f"{self.run_id}-a{getattr(self, 'attempt', 0)}-rank-{spec.rank}",
                namespace=cfg.ray.namespace,
            )
            self.actors.append(ray.remote(RankActor).options(**opts).remote(
                spec.rank, str(self.logs_dir / f"rank_{spec.rank}.log")))
        self.say(f"mindpulse: started {len(specs)} ranks ({cfg.world.nodes} node(s) x {cfg.world.ranks_per_node}, "
                 f"{cfg.world.device.value}, ray backend), scheduler on {sched_host}:{sched_port}")
        infos: list[dict[str, Any]] = []
        try:
            infos = ray.get([a.info.remote() for a in self.actors], timeout=120)
        except Exception as exc:
            self.say(f"mindpulse: ranks did not start: {exc}")
        self.pids["ranks"] = {i["rank"]: i["pid"] for i in infos}
        write_json(self.run_dir / "pids.json", self.pids)
        self.rank_hosts = {i["rank"]: i["host"] for i in infos}
        self.rank_nodes = {i["rank"]: i["node_id"] for i in infos}
        refs = {actor.run.remote(job): ("rank", spec.rank) for actor, spec in zip(self.actors, specs)}
        self._start_telemetry(infos)
        return refs

    def _start_msrun(self, specs, sched_host, sched_port) -> dict:
        cfg = self.cfg
        refs = {}
        for n, agent in enumerate(self.agents):
            spec = next(s for s in specs if s.node == n)
            env = {k: v for k, v in spec.env.items()
                   if k.startswith("MINDPULSE_") or k in cfg.env or k in (
                       "ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GLOG_v")}
            refs[agent.run_msrun.remote(spec.command, env, str(self.logs_dir / f"msrun_node{n}.log"))] = \
                ("node", n)
        self.rank_hosts = {s.rank: self.agent_infos[s.node]["host"] for s in specs}
        self.rank_nodes = {s.rank: self.agent_infos[s.node]["node_id"] for s in specs}
        self.say(f"mindpulse: started msrun on {cfg.world.nodes} node(s) x {cfg.world.ranks_per_node} ranks "
                 f"({cfg.world.device.value}), scheduler on {sched_host}:{sched_port}")
        self._start_telemetry([])
        return refs

    def _start_telemetry(self, infos: list[dict[str, Any]]) -> None:
        import ray

        for n, agent in enumerate(self.agents):
            pids = {i["rank"]: i["pid"] for i in infos if i["rank"] // self.cfg.world.ranks_per_node == n}
            try:
                res = ray.get(agent.start_telemetry.remote(pids), timeout=60)
                if res.get("source") is None and self.cfg.monitor.telemetry_interval_s > 0:
                    self.say(f"mindpulse: no telemetry on {res['node']}: {res.get('reason')}")
            except Exception as exc:
                self.say(f"mindpulse: node agent {n} did not start telemetry: {exc}")

    def _terminate(self, graceful: bool) -> None:
        import ray

        for a in self.actors:
            try:
                if graceful:
                    a.__ray_terminate__.remote()
                else:
                    ray.kill(a, no_restart=True)
            except Exception:
                pass
        if self.agents and self.cfg.backend is Backend.RAY:
            try:
                ray.get(self.agents[0].wait_scheduler.remote(SCHED_EXIT_WAIT_S if graceful else 2),
                        timeout=SCHED_EXIT_WAIT_S + 10)
            except Exception:
                pass
        for a in self.agents:
            try:
                ray.get(a.stop.remote(kill=True), timeout=20)
            except Exception:
                pass
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass

    def _kill_ranks(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        for a in self.agents:
            try:
                a.kill_ranks.remote()
            except Exception:
                pass

    def _poll(self, final: bool = False) -> None:
        import ray

        try:
            info = ray.get(self.aggregator.poll.remote(), timeout=10)
        except Exception:
            return
        for text in info["console"]:
            self.say(text)
        if not final:
            self.progress.update(info["progress"], self.total_steps(), self.started)

    def _check_hang(self) -> list[int]:
        """Ask the aggregator whether the job is hung; if so name the ranks, dump stacks."""
        import ray

        now = time.time()
        if now - getattr(self, "_last_hang_check", 0.0) < 2.0:
            return []
        self._last_hang_check = now
        timeout = self.cfg.monitor.hang_timeout_s
        try:
            info = ray.get(self.aggregator.hang_check.remote(timeout, max(3.0, min(15.0, timeout / 2))), timeout=10)
        except Exception:
            return []
        if not info:
            return []
        stuck = info["stuck"]
        self.say(f"mindpulse: HANG: no rank made progress for {info['no_progress_s']:.0f}s; stuck ranks {stuck} "
                 f"at steps {[info['steps'][r] for r in stuck]}"
                 + (f" (heartbeats silent: {info['silent']})" if info["silent"] else "")
                 + "; dumping every rank's stacks into logs/")
        pids = {int(r): p for r, p in info["pids"].items() if p}
        pids.update({r: p for r, p in (self.pids.get("ranks") or {}).items() if r not in pids})
        rpn = self.cfg.world.ranks_per_node
        for n, agent in enumerate(self.agents):
            mine = {r: p for r, p in pids.items() if r // rpn == n}
            try:
                ray.get(agent.dump_stacks.remote(mine, str(self.logs_dir), info.get("started", [])), timeout=90)
            except Exception as exc:
                self.say(f"mindpulse: stack dump on node {n} failed: {exc}")
        return stuck

    def _collect(self, ref: Any, what: tuple[str, int], outcomes: dict[int, RankOutcome]) -> None:
        import ray

        before = set(outcomes)
        kind, idx = what
        rpn = self.cfg.world.ranks_per_node
        ranks = [idx] if kind == "rank" else list(range(idx * rpn, (idx + 1) * rpn))
        try:
            res = ray.get(ref)
            for r in ranks:
                outcomes[r] = RankOutcome(rank=r, exit_code=res["exit_code"], error=res.get("error", "") if
                                          kind == "rank" else ("" if res["exit_code"] == 0 else
                                                               f"msrun on node {idx} exited {res['exit_code']}"),
                                          traceback=res.get("traceback", ""), pid=res.get("pid"),
                                          host=self.rank_hosts.get(r))
        except Exception as exc:  # the actor died: killed, OOM, segfault
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            for r in ranks:
                outcomes[r] = RankOutcome(rank=r, exit_code=None, error=f"rank process died: {text}",
                                          host=self.rank_hosts.get(r))
        for r in ranks:
            if r not in before and (outcomes[r].exit_code != 0 or outcomes[r].error):
                self.failure_order.append(r)

    def _supervise(self, refs: dict[Any, tuple[str, int]]) -> RunResult:
        import ray

        outcomes: dict[int, RankOutcome] = {}
        pending = list(refs)
        status = RunStatus.RUNNING
        interrupted_at: float | None = None
        message = ""
        last_poll = 0.0
        world = self.cfg.world.world_size
        hang: list[int] = []
        while not status.is_terminal():
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref in done:
                self._collect(ref, refs[ref], outcomes)
            failed = [o for o in outcomes.values() if o.exit_code != 0]
            if failed and pending:
                first = failed[0]
                message = f"rank {first.rank} failed: {first.error or 'exit code ' + str(first.exit_code)}"
                self.say(f"mindpulse: {message}; stopping the other ranks")
                self._kill_ranks()
                for r in range(world):
                    outcomes.setdefault(r, RankOutcome(rank=r, exit_code=None, error=VICTIM))
                pending = []
                status = RunStatus.FAILED
                break
            if self.signals and interrupted_at is None:
                interrupted_at = time.time()
                self.say("mindpulse: interrupt: every rank stops after the next decision step "
                         "(interrupt again to kill)")
                try:
                    self.aggregator.request_stop.remote("interrupted by the user (signal)", "interrupt", True)
                except Exception:
                    pass
            if self.signals >= 2 and pending:
                self.say("mindpulse: second interrupt: killing every rank")
                self._kill_ranks()
                for r in range(world):
                    outcomes.setdefault(r, RankOutcome(rank=r, exit_code=None, error="killed"))
                pending = []
                status = RunStatus.INTERRUPTED
                break
            if time.time() - last_poll > 0.5:
                self._poll()
                last_poll = time.time()
                stuck = self._check_hang()
                if stuck and pending:
                    hang = stuck
                    message = f"hang: ranks {stuck} made no progress for {self.cfg.monitor.hang_timeout_s:g}s"
                    self._kill_ranks()
                    for r in range(world):
                        outcomes.setdefault(r, RankOutcome(rank=r, exit_code=None,
                                                           error="stuck" if r in stuck else VICTIM))
                    pending = []
                    status = RunStatus.FAILED
                    break
            if not pending:
                if failed:
                    status = RunStatus.FAILED
                    first = failed[0]
                    message = f"rank {first.rank} failed: {first.error or 'exit code ' + str(first.exit_code)}"
                elif interrupted_at is not None:
                    status = RunStatus.INTERRUPTED
                else:
                    status = RunStatus.SUCCEEDED
        self.progress.clear()
        return RunResult(status=status, outcomes=outcomes, message=message, order=list(self.failure_order),
                         hang=hang)

    # ---- the end ---------------------------------------------------------------------------
    def _write_summary(self, result: RunResult, snap: dict[str, Any]) -> RunStatus:
        from mindpulse.aggregator.tables import summary_table, totals_table

        status = result.status
        stop = snap.get("stop")
        if status is RunStatus.SUCCEEDED and stop and stop.get("rule") not in (None, "interrupt"):
            status = RunStatus.ANOMALY_STOP
        if stop and stop.get("rule") == "interrupt" and status is RunStatus.SUCCEEDED:
            status = RunStatus.INTERRUPTED
        ranks = []
        for r in range(self.cfg.world.world_size):
            base = next((x for x in snap.get("ranks", []) if x["rank"] == r), {"rank": r, "last_step": 0,
                                                                               "param_fingerprint": None})
            o = result.outcomes.get(r)
            ranks.append(dict(base, exit_code=o.exit_code if o else None, error=o.error if o else "",
                              pid=base.get("pid") or (o.pid if o else None),
                              node=r // self.cfg.world.ranks_per_node,
                              node_id=getattr(self, "rank_nodes", {}).get(r)))
        summary = {
            "status": status.value,
            "exit_code": int(ExitCode.of(status)),
            "run_dir": str(self.run_dir),
            "name": self.cfg.name,
            "world_size": self.cfg.world.world_size,
            "steps_completed": snap.get("steps_completed", 0),
            "ranks": ranks,
            "stop": stop if status is not RunStatus.SUCCEEDED else None,
            "best_checkpoint": snap.get("best_checkpoint"),
            "anomalies": snap.get("anomalies", 0),
            "resumed_from": self.resume,
            "attempts": getattr(self, "attempts", []),
            "aggregator_lost": getattr(self, "aggregator_lost", False),
            "message": result.message,
            "first_loss": snap.get("first_loss"),
            "last_loss": snap.get("last_loss"),
            "best_loss": snap.get("best_loss"),
            "best_loss_step": snap.get("best_loss_step"),
            "fingerprints_equal": snap.get("fingerprints_equal"),
            "packets": dict(snap.get("packets", {}), dropped=getattr(self, "dropped_packets", 0),
                            aggregator_restarts=snap.get("aggregator_restarts", 0)),
            "pids": self.pids,
            "started": self.started,
            "wall_time_s": time.time() - self.started,
        }
        summary["failure"] = None
        if status is RunStatus.FAILED:
            from .failures import FailureKind, describe_failure, format_failure

            last_steps = {x["rank"]: x["last_step"] for x in ranks}
            kind = FailureKind.HANG if result.hang else (
                FailureKind.LAUNCHER if not result.outcomes else FailureKind.CRASH)
            summary["failure"] = describe_failure(result.outcomes, result.order,
                                                  getattr(self, "logs_dir", self.run_dir / "logs"), last_steps,
                                                  kind, stuck=result.hang, message=result.message)
            self.say(format_failure(summary["failure"]))
        write_json(self.run_dir / "summary.json", summary)
        self.say("")
        self.say(summary_table(ranks))
        self.say("")
        self.say(totals_table(summary))
        self.say(f"\nmindpulse: {status.value} (exit code {int(ExitCode.of(status))}); "
                 f"run directory {self.run_dir}")
        self.summary = summary
        if self.cfg.output.report:
            try:
                from mindpulse.aggregator.report import build_report

                rep = build_report(self.run_dir)
                self.say(f"mindpulse: report {rep['html']}")
            except Exception as exc:  # the run's outcome stands; say why there is no report
                self.say(f"mindpulse: could not write the report: {type(exc).__name__}: {exc}")
        return status


def launch(cfg: RunConfig, config_path: Path | None, resume: dict[str, Any] | None = None) -> int:
    return Launch(cfg, config_path, resume=resume).run()
