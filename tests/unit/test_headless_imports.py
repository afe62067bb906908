"""Every module the head runs (the driver, the aggregator, the node agent, the views and the
shared base) imports where neither MindSpore nor MindFormers can be imported: the quick
check, in this environment with both blocked; tests/integration/test_headless_head.py runs
the head for real in an environment that holds neither."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAD_PACKAGES = ("mindpulse", "mindpulse.common", "mindpulse.registry", "mindpulse.wire", "mindpulse.reduction",
                 "mindpulse.config", "mindpulse.rundir", "mindpulse.lifetime", "mindpulse.frameworks",
                 "mindpulse.inputs", "mindpulse.reporting", "mindpulse.rules", "mindpulse.launcher",
                 "mindpulse.aggregator", "mindpulse.node", "mindpulse.node.npu_smi", "mindpulse.node.samplers",
                 "mindpulse.views", "mindpulse.views.report")

PROBE = textwrap.dedent("""\
    import importlib, json, pkgutil, sys

    class Blocked:
        # as where the package is not installed: `import mindspore` raises ModuleNotFoundError
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("mindspore", "mindformers"):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Blocked())
    failed, seen = {}, []
    for pkg in PACKAGES:
        for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__, pkg + "."):
            if m.ispkg:
                continue
            seen.append(m.name)
            try:
                importlib.import_module(m.name)
            except Exception as exc:  # every failure is collected and reported by the test
                failed[m.name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"failed": failed, "seen": seen}))
""")


def test_every_head_module_imports_without_mindspore_or_mindformers():
    import json
    import pkgutil

    import mindpulse

    base = {f"mindpulse.{m.name}" for m in pkgutil.iter_modules(mindpulse.__path__) if m.ispkg}
    assert base - set(HEAD_PACKAGES) == set(), "base packages the probe below would not import"

    code = f"PACKAGES = {HEAD_PACKAGES!r}\n" + PROBE
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["failed"], f"head modules that need a framework at import: {out['failed']}"
    for module in ("mindpulse.launcher.launch", "mindpulse.aggregator.core", "mindpulse.node.agent",
                   "mindpulse.views.top", "mindpulse.launcher.rules_cmd", "mindpulse.frameworks.framework_support",
                   "mindpulse.rules.changes", "mindpulse.wire.uplink"):
        assert module in out["seen"], f"{module} was not among the modules imported"
