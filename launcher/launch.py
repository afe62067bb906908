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
from .spec import ExitCode, RankOutcome, RunResult, RunStatus, free_port, rank_specs

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
        self.sched: subprocess.Popen | None = None
        self.actors: list[Any] = []
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
        write_config(self.run_dir, self.cfg)
        self.say(f"mindpulse: run directory {self.run_dir}")
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        result = RunResult(status=RunStatus.FAILED, message="launcher did not start")
        snapshot: dict[str, Any] = {}
        try:
            with RaySession(self.cfg) as session:
                self.session = session
                result, snapshot = self._run_in_ray()
        except Exception as exc:
            log.exception("launcher failed")
            result = RunResult(status=RunStatus.FAILED, message=f"launcher error: {type(exc).__name__}: {exc}")
        finally:
            self._stop_scheduler()
            for s, h in old.items():
                signal.signal(s, h)
        status = self._write_summary(result, snapshot)
        return int(ExitCode.of(status))

    def _run_in_ray(self) -> tuple[RunResult, dict[str, Any]]:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from mindpulse.aggregator.actor import actor_name, start_aggregator
        from mindpulse.workers.rank_actor import RankActor

        cfg = self.cfg
        world = cfg.world.world_size
        node_id = ray.get_runtime_context().get_node_id()
        plain = cfg.to_dict()
        settings = {"anomalies": plain["anomalies"], "checkpoint": plain["checkpoint"], "eval": plain["eval"],
                    "tensorboard": cfg.output.tensorboard, "monitor": plain["monitor"],
                    "config_yaml": (self.run_dir / "config.yaml").read_text()}
        self.aggregator = start_aggregator(self.run_id, cfg.ray.namespace, self.run_dir, world,
                                           cfg.monitor.per_print_step, self.total_steps(), node_id=node_id,
                                           settings=settings)
        ray.get(self.aggregator.ping.remote(), timeout=60)

        sched_host = "127.0.0.1" if self.session.embedded else ray.util.get_node_ip_address()
        sched_port = free_port(sched_host)
        run_env = {
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
            "GLOG_v": os.environ.get("GLOG_v", "2"),
        }
        specs = rank_specs(cfg, sched_host, sched_port, run_env)
        self._start_scheduler(sched_host, sched_port, world)

        resource = {"cpu": {"CPU": 1}, "ascend": {"NPU": 1}, "gpu": {"GPU": 1}}[cfg.world.device.value]
        pg = placement_group([dict(resource) for _ in range(world)], strategy="PACK")
        ray.get(pg.ready(), timeout=120)
        job = cfg.to_dict()
        job["resume"] = self.resume
        for spec in specs:
            opts: dict[str, Any] = dict(
                num_cpus=resource.get("CPU", 0),
                resources={k: v for k, v in resource.items() if k != "CPU"},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.rank),
                runtime_env={"env_vars": dict(WORKER_ENV, **spec.env)},
                max_restarts=0,
                name=f"{self.run_id}-rank-{spec.rank}",
                namespace=cfg.ray.namespace,
            )
            actor = ray.remote(RankActor).options(**opts).remote(spec.rank, str(self.run_dir / "logs" / f"rank_{spec.rank}.log"))
            self.actors.append(actor)
        self.say(f"mindpulse: started {world} ranks ({cfg.world.nodes} node(s) x {cfg.world.ranks_per_node}, "
                 f"{cfg.world.device.value}), scheduler on {sched_host}:{sched_port}")
        infos: list[dict[str, Any]] = []
        try:
            infos = ray.get([a.info.remote() for a in self.actors], timeout=120)
            self.pids["ranks"] = {i["rank"]: i["pid"] for i in infos}
            self.rank_hosts = {i["rank"]: i["host"] for i in infos}
        except Exception as exc:
            self.say(f"mindpulse: ranks did not start: {exc}")
            self.rank_hosts = {}
        refs: dict[Any, int] = {actor.run.remote(job): spec.rank for actor, spec in zip(self.actors, specs)}
        self._start_agents(specs, infos)

        result = self._supervise(refs)
        self._stop_agents()
        snapshot: dict[str, Any] = {}
        try:
            # drain the last tables, then close the aggregator (flushes metrics.msgpack)
            self._poll(final=True)
            snapshot = ray.get(self.aggregator.close.remote(), timeout=30)
        except Exception as exc:
            self.say(f"mindpulse: aggregator did not answer at the end: {exc}")
        self._terminate_actors(graceful=result.status is not RunStatus.FAILED)
        try:
            remove_placement_group(pg)
        except Exception:
            pass
        return result, snapshot

    def _start_agents(self, specs: list, infos: list[dict[str, Any]]) -> None:
        """One NodeAgent per Ray node hosting ranks: it samples that node's cards."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .node_agent import NodeAgent

        self.agents = []
        by_node: dict[str, list[dict[str, Any]]] = {}
        for info in infos:
            by_node.setdefault(info["node_id"], []).append(info)
        device_of = {s.rank: s.device_id for s in specs}
        for index, (node_id, ranks) in enumerate(sorted(by_node.items(), key=lambda kv: min(i["rank"] for i in kv[1]))):
            agent = ray.remote(NodeAgent).options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                runtime_env={"env_vars": dict(WORKER_ENV)},
            ).remote(index, self.aggregator, self.cfg.world.device.value,
                     {i["rank"]: device_of[i["rank"]] for i in ranks}, self.cfg.monitor.telemetry_interval_s)
            self.agents.append(agent)
            pids = {i["rank"]: i["pid"] for i in ranks}
            try:
                res = ray.get(agent.start.remote(pids), timeout=60)
                if res.get("source") is None and self.cfg.monitor.telemetry_interval_s > 0:
                    self.say(f"mindpulse: no telemetry on {res['node']}: {res.get('reason')}")
            except Exception as exc:
                self.say(f"mindpulse: node agent {index} did not start: {exc}")

    def _stop_agents(self) -> None:
        import ray

        for agent in getattr(self, "agents", []):
            try:
                ray.get(agent.stop.remote(), timeout=15)
                ray.kill(agent)
            except Exception:
                pass

    def _start_scheduler(self, host: str, port: int, world: int) -> None:
        env = dict(os.environ)
        env.update(WORKER_ENV)
        env.update({"MS_ROLE": "MS_SCHED", "MS_SCHED_HOST": host, "MS_SCHED_PORT": str(port),
                    "MS_WORKER_NUM": str(world), "GLOG_v": os.environ.get("GLOG_v", "2"),
                    "MINDPULSE_DEVICE_TARGET": self.cfg.world.device.device_target})
        logf = open(self.run_dir / "logs" / "scheduler.log", "ab")
        self.sched = subprocess.Popen([sys.executable, "-m", "mindpulse.workers.scheduler"], env=env,
                                      stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        logf.close()
        self.pids["scheduler"] = self.sched.pid

    def _stop_scheduler(self) -> None:
        if self.sched is None or self.sched.poll() is not None:
            return
        try:
            self.sched.wait(timeout=SCHED_EXIT_WAIT_S if self.signals < 2 else 1)
        except subprocess.TimeoutExpired:
            self.sched.terminate()
            try:
                self.sched.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.sched.kill()
                self.sched.wait()

    def _terminate_actors(self, graceful: bool) -> None:
        import ray

        for a in self.actors:
            try:
                if graceful:
                    a.__ray_terminate__.remote()
                else:
                    ray.kill(a, no_restart=True)
            except Exception:
                pass
        if self.sched is not None and self.sched.poll() is None:
            try:
                self.sched.wait(timeout=SCHED_EXIT_WAIT_S if graceful else 2)
            except subprocess.TimeoutExpired:
                self.sched.kill()

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

    def _supervise(self, refs: dict[Any, int]) -> RunResult:
        import ray

        outcomes: dict[int, RankOutcome] = {}
        pending = list(refs)
        status = RunStatus.RUNNING
        interrupted_at: float | None = None
        message = ""
        last_poll = 0.0
        while not status.is_terminal():
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref in done:
                rank = refs[ref]
                try:
                    res = ray.get(ref)
                    outcomes[rank] = RankOutcome(rank=rank, exit_code=res["exit_code"], error=res["error"],
                                                 traceback=res["traceback"], pid=res["pid"],
                                                 host=self.rank_hosts.get(rank))
                except Exception as exc:  # the actor died: killed, OOM, segfault
                    outcomes[rank] = RankOutcome(rank=rank, exit_code=None, error=f"rank process died: {exc}",
                                                 host=self.rank_hosts.get(rank))
            failed = [o for o in outcomes.values() if o.exit_code != 0]
            if failed and pending:
                first = failed[0]
                message = f"rank {first.rank} failed: {first.error or 'exit code ' + str(first.exit_code)}"
                self.say(f"mindpulse: {message}; stopping the other ranks")
                for a in self.actors:
                    ray.kill(a, no_restart=True)
                for ref in pending:
                    outcomes.setdefault(refs[ref], RankOutcome(rank=refs[ref], exit_code=None,
                                                               error="stopped after another rank failed"))
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
                for a in self.actors:
                    ray.kill(a, no_restart=True)
                for ref in pending:
                    outcomes.setdefault(refs[ref], RankOutcome(rank=refs[ref], exit_code=None, error="killed"))
                pending = []
                status = RunStatus.INTERRUPTED
                break
            if time.time() - last_poll > 0.5:
                self._poll()
                last_poll = time.time()
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
        return RunResult(status=status, outcomes=outcomes, message=message)

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
                              pid=base.get("pid") or (o.pid if o else None)))
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
            "message": result.message,
            "first_loss": snap.get("first_loss"),
            "last_loss": snap.get("last_loss"),
            "best_loss": snap.get("best_loss"),
            "best_loss_step": snap.get("best_loss_step"),
            "fingerprints_equal": snap.get("fingerprints_equal"),
            "packets": snap.get("packets", {}),
            "pids": self.pids,
            "started": self.started,
            "wall_time_s": time.time() - self.started,
        }
        failures = result.failures
        if failures:
            summary["errors"] = {str(r): {"error": o.error, "traceback": o.traceback[-4000:]}
                                 for r, o in failures.items()}
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
