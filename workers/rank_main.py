"""The rank's entry point: `python -m mindpulse.workers.rank_main --job RUN_DIR/job.json`.

msrun starts it once per rank (and once more as the scheduler, MS_ROLE=MS_SCHED, on the
master node); the Ray backend's rank actor calls `run_job` in-process, so both backends
run the same code with the same settings (`RankSettings`, from the run's job.json).
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import socket
import sys
import time
import traceback
from typing import Any

# mindspore's generated protobuf code needs the pure-Python implementation when something
# imported protobuf before it; set before anything imports protobuf
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

if __package__ in (None, ""):  # run as a file by msrun: make `mindpulse` importable the same way
    sys.path.pop(0)

from mindpulse.config import RunConfig, from_dict  # noqa: E402
from mindpulse.config.rank_settings import SETTINGS_ENV, RankSettings  # noqa: E402
from mindpulse.frameworks.framework_support import FrameworkVersionError, needed  # noqa: E402
from mindpulse.inputs.input_paths import INPUT_MISSING, InputMissing, input_problems  # noqa: E402
from mindpulse.workers import framework_check  # noqa: E402
from mindpulse.workers.errors import StopTraining  # noqa: E402
from mindpulse.workers.heartbeat import dump_stacks_on_sigusr1  # noqa: E402
from mindpulse.workers.settings import SettingsError, node_rank, rank_id, settings_at  # noqa: E402


def run_job(settings: RankSettings | None, rank: int) -> dict[str, Any]:
    """Run the recipe or the user's script; returns exit code, error and traceback (never raises).
    `settings` None: this process was not launched by mindpulse, which is reported as the error."""
    t0 = time.time()
    code, error, tb = 0, "", ""
    dump_stacks_on_sigusr1()  # from the start: a hang during init must be dumpable too
    print(f"[rank {rank}] pid {os.getpid()} starting", flush=True)
    try:
        if settings is None:
            raise SettingsError(f"{SETTINGS_ENV} names no settings: this process was not launched by mindpulse")
        cfg = from_dict(settings.config, source="job.json config")
        job = cfg.job
        if job.mindformers is not None and job.mindformers.source:
            framework_check.put_first(job.mindformers.source)
        # before anything imports either framework: a missing or unsupported one is named here
        found = framework_check.check(needed(job, settings.task))
        print(f"[rank {rank}] " + "; ".join(f.line() for f in found), flush=True)
        if settings.task != "card_check":
            check_inputs(cfg, rank)
        if settings.task == "card_check":  # the pre-flight card check only (launcher/card_check.py)
            from mindpulse.workers.card_check import main as card_check

            card_check(settings)
        elif job.mindformers is not None:  # a MindFormers YAML, trained by MindFormers' Trainer
            from mindpulse.workers.mindformers_job import run_for_rank

            run_for_rank(settings, rank)
        elif job.script:
            run_script(settings, rank, job.script, list(job.args), job.auto_monitor)
        else:
            from mindpulse.workers.recipes import llama_finetune

            llama_finetune.main(settings)
    except StopTraining as exc:
        print(f"[rank {rank}] stopped before the next step: {exc}", flush=True)
    except FrameworkVersionError as exc:  # said in one line, no traceback: the message is the fix
        code, error = framework_check.REFUSED_EXIT, f"{type(exc).__name__}: {exc}"
        print(f"[rank {rank}] mindpulse: {exc}", file=sys.stderr, flush=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            error = f"SystemExit({exc.code!r})"
    except InputMissing as exc:  # a config key's file missing on this node: the message says all, no traceback
        code, error = 1, f"{INPUT_MISSING}: {exc}"
        print(f"[rank {rank}] {error}", file=sys.stderr, flush=True)
    except BaseException as exc:  # report everything; the launcher decides
        code, error, tb = 1, f"{type(exc).__name__}: {exc}", traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
    finally:
        release_communication(rank)
    print(f"[rank {rank}] finished with exit code {code} after {time.time() - t0:.1f}s", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    return {"rank": rank, "exit_code": code, "error": error, "traceback": tb, "pid": os.getpid()}


def check_inputs(cfg: RunConfig, rank: int) -> None:
    """The files this rank will open, checked before it joins MindSpore's cluster: the driver
    checked them on the head, but this node may lack one (a path that is not on a filesystem
    every host shares). Raises `InputMissing` naming the key, the path and the node."""
    node = rank // cfg.world.ranks_per_node
    problems = input_problems(cfg, where=f"on node {node} ({socket.gethostname()})")
    if problems:
        raise InputMissing("; ".join(problems) + ": every node must see the job's files at the same path "
                           "(a shared filesystem, or a copy on each host)")


def run_script(settings: RankSettings, rank: int, script: str, args: list[str], auto_monitor: bool) -> None:
    """The user's script as `__main__`, watched without an edit (workers/auto_attach.py):
    `job.auto_monitor` adds the Monitor and the gradient statistics; either way a script that
    trains without a Monitor is named at once."""
    from mindpulse.workers.auto_attach import install

    attached = install(settings, rank, auto_monitor)
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
        attached.at_script_end()
    except SystemExit as exc:
        if exc.code in (0, None):  # `sys.exit(0)` / `sys.exit(main())`: the script's normal end
            attached.at_script_end()
        raise
    finally:
        attached.finish()
        attached.uninstall()


def release_communication(rank: int) -> None:
    """Leave the MindSpore cluster gracefully: a hard exit makes the scheduler wait ~30 s."""
    if "mindspore" not in sys.modules:
        return
    try:
        from mindspore.communication import release
        from mindspore.communication.management import GlobalComm

        if getattr(GlobalComm, "INITED", False):
            release()
    except Exception as exc:  # best effort cleanup at exit: said on stderr
        print(f"[rank {rank}] communication release failed: {exc}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True, help="the run's job.json (its RankSettings)")
    args = ap.parse_args(argv)
    try:
        settings = settings_at(args.job)
    except SettingsError as exc:
        print(f"mindpulse rank: {exc}", file=sys.stderr, flush=True)
        return 2
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        # msrun starts the scheduler from the same script on every node whose address is
        # the master's; only node 0 hosts it (on one machine all "nodes" look like masters)
        if node_rank() != 0:
            print("not node 0: no MindSpore scheduler here", flush=True)
            return 0
        from mindpulse.workers.scheduler import main as sched_main

        return sched_main()
    rank = rank_id()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s")
    res = run_job(settings, rank)
    return int(res["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
