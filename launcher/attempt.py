"""One attempt of the run: its aggregator, its nodes' agents and its worker group, from
start to teardown. Attempt k's logs go to logs/ (k = 0) or logs/attempt_<k>/.

Start order: the aggregator actor → the placement group and the node agents' actors →
the scheduler's address (from the nodes the group was placed on) → the rank specs
(plan.json) → the rank actors; their processes start side by side, and once the agents
answer: the settings (job.json, now that the relays are known) → the scheduler → the
ranks' job → telemetry.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mindpulse.config import AUTO_HANG_MIN_S, RunConfig
from mindpulse.rundir.rundir_io import write_atomic

from . import interrupts as waits
from .interrupts import Interrupts
from .node_agents import NodeAgents
from .progress import Console
from .ray_session import RaySession
from .rundir import PidFile, apply_run_mode, make_dir, run_modes, write_json
from .spec import RunResult, RunStatus, aggregator_settings, rank_settings, rank_specs, settings_path_of
from .worker_group import RefOwner, WorkerGroup, worker_group

AGGREGATOR_TIMEOUT_S = 60


def logs_dir_of(run_dir: Path, index: int) -> Path:
    return run_dir / "logs" if index == 0 else run_dir / "logs" / f"attempt_{index}"


class Attempt:
    def __init__(self, cfg: RunConfig, *, index: int, run_dir: Path, run_id: str, session: RaySession,
                 resume: dict[str, Any] | None, pids: PidFile, console: Console,
                 goodput: dict[str, Any] | None = None, task: str = "train",
                 interrupts: Interrupts | None = None):
        self.cfg = cfg
        self.task = task
        """What the ranks run: `train`, or `card_check` (the pre-flight check: launcher/card_check.py)."""
        self.index = index
        self.run_dir = run_dir
        self.run_id = run_id
        self.session = session
        self.resume = resume
        self.goodput = goodput or {}
        """The launch's start and the productive seconds of earlier attempts (live goodput/ettr)."""
        self.pids = pids
        self.console = console
        self.logs_dir = make_dir(logs_dir_of(run_dir, index), run_modes(cfg)[1])
        # attempt k > 0 has its own aggregator (and rank actor names): the last one's may linger
        self.name = run_id + (f"-a{index}" if index else "")
        self.aggregator: Any = None
        self.interrupts = interrupts
        self.interrupted: Callable[[], bool] | None = interrupts.pending if interrupts is not None else None
        """Set: the start gives up (interrupts.StartInterrupted) at the user's first interrupt."""
        self.nodes = NodeAgents(cfg, self.interrupted)
        self.group: WorkerGroup = worker_group(cfg, self.nodes, self.logs_dir, pids, console.say,
                                               actor_prefix=f"{run_id}-a{index}")
        self.dropped_packets = 0
        self.aggregator_lost = False
        self.unshared: list[dict[str, Any]] = []
        """The hosts that do not see the run directory (launcher/shared_output.py)."""

    def total_steps(self) -> int | None:
        return self.cfg.train.steps or None

    def start_step(self) -> int:
        """The step this attempt starts after (the checkpoint it resumes from; 0 when fresh)."""
        return int((self.resume or {}).get("step") or 0)

    # ---- start ------------------------------------------------------------------------------
    def start(self) -> dict[Any, RefOwner]:
        import ray

        from mindpulse.reporting.card_peaks import peak_dtype

        from . import mindformers_plan
        from .doors import aggregator_actor_name, start_aggregator
        from .preflight import check_cluster
        from .resume import best_seed

        cfg = self.cfg
        check_cluster(cfg, ray.cluster_resources(), [n for n in ray.nodes() if n.get("Alive")])
        agg_settings = aggregator_settings(
            cfg, attempt=self.index, start_step=self.start_step(),
            rollbacks=(self.resume or {}).get("rollbacks"),  # per rule, this launch
            goodput=self.goodput,
            # MFU's peak from the table of known cards, in the dtype the job computes in
            peak_dtype=peak_dtype(cfg.job.script, mindformers_plan.compute_dtype(cfg, str(self.run_dir))),
            config_yaml=(self.run_dir / "config.yaml").read_text(),
            # the manifest's best: a restarted run keeps it until a step beats it
            best=best_seed(self.run_dir / "checkpoints"))
        self.aggregator = start_aggregator(self.name, cfg.ray.namespace, self.run_dir, cfg.world.world_size,
                                           cfg.monitor.per_print_step, self.total_steps(),
                                           node_id=ray.get_runtime_context().get_node_id(), settings=agg_settings)
        tag = getattr(self.session, "private_dir", "") and self.session.temp_dir
        if tag:  # in the environment of every process of an embedded run (MINDPULSE_RUN_TAG)
            self.pids["run_tag"] = tag
            self.pids.save()  # before anything else starts: what cleans up after a killed launcher reads it

        import secrets

        relay_token = secrets.token_hex(16)  # the ranks' key to their node's relay, this attempt only
        # the aggregator's, the agents' and the ranks' processes start side by side (each is a
        # Ray worker importing its modules: seconds apiece); the ranks' job starts once the
        # agents' relays are known (the settings) and the scheduler runs
        self.nodes.reserve(self.aggregator, relay_token)
        sched_host, sched_port = self.nodes.sched_endpoint(self.session.embedded)
        settings_path = settings_path_of(str(self.run_dir))
        specs = rank_specs(cfg, run_dir=str(self.run_dir), logs_dir=str(self.logs_dir), settings_path=settings_path,
                           sched_host=sched_host, sched_port=sched_port)
        write_json(self.run_dir / "plan.json", [s.to_dict() for s in specs])
        self.group.spawn(specs, sched_host)
        self.nodes.wait_ready()
        self._check_shared_output()
        settings = rank_settings(cfg, run_dir=str(self.run_dir), run_id=self.run_id, attempt=self.index,
                                 aggregator=aggregator_actor_name(self.name), ray_address=self.session.address,
                                 relays=self.nodes.relays(), resume=self.resume, relay_token=relay_token,
                                 task=self.task)
        write_atomic(Path(settings_path), settings.to_json().encode())
        self.pids["aggregator"] = waits.get(self.aggregator.ping.remote(), AGGREGATOR_TIMEOUT_S, self.interrupted,
                                            "the aggregator")
        self.pids["agents"] = self.nodes.pids()
        self.pids.save()  # for operators (and tests) while it runs

        refs = self.group.start(specs, sched_host, sched_port, settings_path)
        self.nodes.start_telemetry(self.group.rank_pids, self.console.say)
        return refs

    def _check_shared_output(self) -> None:
        """Which hosts do not see the run directory (launcher/shared_output.py); a refusal
        (`checkpoint.require_shared`) ends what this attempt started first."""
        from .preflight import LaunchRefused
        from .shared_output import check_shared_output

        try:
            self.unshared = check_shared_output(self.cfg, self.run_dir, self.nodes.agents, self.nodes.infos,
                                                self.console.say)
        except LaunchRefused:
            self.abort()
            raise

    # ---- while it runs ----------------------------------------------------------------------
    def poll(self, final: bool = False) -> dict[str, Any] | None:
        """Print the aggregator's new console lines; returns its progress (None: no answer)."""
        import ray

        try:
            info = ray.get(self.aggregator.poll.remote(), timeout=10)
        except Exception:  # no answer this tick: no progress shown, asked again at the next
            return None
        for text in info["console"]:
            self.console.say(text)
        return None if final else info["progress"]

    def hang_check(self) -> dict[str, Any] | None:
        """The aggregator's verdict: None, or the stuck ranks with their steps and pids."""
        import ray

        timeout = self.cfg.monitor.hang_timeout_s  # None: auto, from the reduced steps' times
        stale = max(3.0, min(15.0, (timeout or AUTO_HANG_MIN_S) / 2))
        try:
            return ray.get(self.aggregator.hang_check.remote(timeout, stale), timeout=10)
        except Exception:  # no answer: no hang verdict this tick, asked again at the next
            return None

    def save_in_progress(self) -> dict[str, Any] | None:
        """Rank 0's save-in-progress marker (`NodeAgents.saving_now`)."""
        return self.nodes.saving_now(str(self.run_dir / "checkpoints"))

    def request_stop(self, reason: str) -> None:
        """Every rank stops after the next decision step (the aggregator's stop directive)."""
        try:
            self.aggregator.request_stop.remote(reason, "interrupt", True)
        except Exception:  # best effort: the ranks are killed anyway if they do not stop
            pass

    def kill_ranks(self) -> None:
        self.group.kill()

    # ---- the end ----------------------------------------------------------------------------
    def finish(self, result: RunResult, graceful: bool) -> dict[str, Any]:
        """Flush telemetry and packets, close the aggregator (its snapshot is returned), end
        the ranks and the agents, give the cards back."""
        import ray

        self.dropped_packets += self.nodes.flush(kill=result.status is RunStatus.FAILED)
        snapshot: dict[str, Any] = {}
        try:
            self.poll(final=True)
            snapshot = ray.get(self.aggregator.close.remote(), timeout=30)
        except Exception as exc:  # a lost aggregator costs the cluster metrics, not the ranks' results: said, flagged
            self.console.say(f"mindpulse: WARNING the aggregator did not answer at the end ({exc}); the ranks' own "
                             "results stand, the cluster metrics are incomplete (metrics.msgpack has what it "
                             "accepted)")
            self.aggregator_lost = True
        self.terminate(graceful)
        try:
            ray.kill(self.aggregator, no_restart=True)  # closed: its state is in summary and metrics
        except Exception:  # already gone with its node or Ray: there is nothing left to end
            pass
        self.nodes.release()
        # what msrun, MindSpore and TensorBoard wrote with their own umask follows output.mode
        for err in apply_run_mode(self.run_dir, self.cfg)[:3]:
            self.console.say(f"mindpulse: WARNING could not set the permissions of {err}")
        return snapshot

    def terminate(self, graceful: bool) -> None:
        self.group.terminate(graceful)
        self.nodes.shutdown()

    def abort(self, interrupted: bool = False) -> dict[str, Any]:
        """The launcher failed mid-attempt, or the user interrupted its start: kill what was
        started and give the cards back (a next attempt reserves them again). Returns the
        aggregator's final snapshot ({} without one). `interrupted`: the agents are asked to stop
        all at once and killed after a short grace (one may still be starting, and a call
        would queue behind that: `NodeAgents.kill`), and a second interrupt stops waiting for
        the aggregator's files."""
        import ray

        self.kill_ranks()
        if interrupted:  # the ranks were killed just above
            self.nodes.kill()
        else:
            self.terminate(graceful=False)
        snapshot: dict[str, Any] = {}
        if self.aggregator is not None:  # closed first (its files flushed), then gone: a restart starts its own
            try:
                intr = self.interrupts
                again = (lambda: intr.count >= 2) if interrupted and intr is not None else None
                snapshot = waits.get(self.aggregator.close.remote(), 10, again, "the aggregator's close")
            # best effort at abort: the aggregator is killed next, the run is ending anyway
            except (Exception, waits.StartInterrupted):
                pass
            try:
                ray.kill(self.aggregator, no_restart=True)
            except Exception:  # best effort cleanup: the actor may be gone already
                pass
        self.nodes.release()
        return snapshot
