"""MindFormers' own Trainer fine-tunes the tiny LLaMA from its YAML on CPU
(workers/mindformers_job.py, workers/recipes/mindformers/llama_tiny_finetune.yaml): the path of
MindFormers' run_mindformer.py, with the loss-scale cell's overflow check made CPU-capable
(workers/cpu_fallbacks.py). One process, in a fresh interpreter, 12 steps."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

YAML = Path(__file__).resolve().parents[2] / "workers" / "recipes" / "mindformers" / "llama_tiny_finetune.yaml"
STEPS = 12

# a rank's code with a MindSpore callback that writes what it sees in each step's outputs
RANK_SCRIPT = textwrap.dedent("""\
    import json, sys
    from mindspore.train import Callback
    from mindpulse.config import mindformers_yaml as my
    from mindpulse.workers import mindformers_job as mj

    class Record(Callback):
        def __init__(self, path):
            self.out = open(path, "w")

        def on_train_step_end(self, run_context):
            cb = run_context.original_args()
            outs = cb.net_outputs
            row = {"step": cb.cur_step_num, "n_outputs": len(outs),
                   "dtypes": [str(o.dtype) for o in outs], "values": [o.asnumpy().reshape(-1)[0].item() for o in outs]}
            self.out.write(json.dumps(row) + "\\n")
            self.out.flush()

    yaml_path, out_dir, steps, record = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    config = my.load_mf_config(yaml_path)
    config = my.apply_launch_settings(config, my.LaunchSettings(output_dir=out_dir, device_target="CPU",
                                                                 log_dir=out_dir + "/log", max_steps=steps))
    mj.run_trainer(config, [Record(record)])
""")


@pytest.mark.slow
@pytest.mark.cluster
def test_mindformers_trainer_finetunes_the_yaml_on_cpu(tmp_path):
    script, record = tmp_path / "rank.py", tmp_path / "steps.jsonl"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    env.pop("LOG_MF_PATH", None)
    # cwd: MindSpore and MindFormers write a few folders (kernel_meta, rank_0) where they run
    proc = subprocess.run([sys.executable, str(script), str(YAML), str(tmp_path / "out"), str(STEPS), str(record)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "the step cap did not stop at 12 steps"
    # MFTrainOneStepCell's outputs: (loss, overflow, loss scale, learning rate, global norm)
    for r in rows:
        assert r["n_outputs"] == 5 and r["dtypes"] == ["Float32", "Bool", "Float32", "Float32", "Float32"], r
        loss, overflow, scale, lr, norm = r["values"]
        assert math.isfinite(loss) and overflow is False and scale == 1.0, r
        assert 0.0 <= lr <= 5e-3 and math.isfinite(norm) and norm > 0.0, r
    losses = [r["values"][0] for r in rows]
    first, last = statistics.fmean(losses[:3]), statistics.fmean(losses[-3:])
    assert last < first, f"loss did not fall: first steps {first:.4f}, last steps {last:.4f}: {losses}"
    assert len({r["values"][3] for r in rows}) > 1, "the learning rate never changed (no schedule?)"
    # MindFormers' own MFLossMonitor (the YAML's callback) ran beside the caller's
    log = (tmp_path / "out" / "log" / "rank_0" / "info.log").read_text()
    assert f"step:[   {STEPS}/" in log and "loss_scale: 1.0" in log, log[-3000:]
