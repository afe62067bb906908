"""The recipe imports MindFormers' model classes without its text-metric and Hugging Face data
packages (workers/lean_mindformers.py); whatever needs one of them says so, and the real
packages stay importable."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from mindpulse.workers.lean_mindformers import LeftOut, StandIn, standing_in_for


def test_a_stood_in_package_and_its_submodules_refuse_use_and_leave_sys_modules():
    name = "mindpulse_left_out_pkg"
    with standing_in_for((name, "json")) as left_out:
        assert left_out == (name,), "a package imported already is never stood in for"
        mod = importlib.import_module(f"{name}.sub.deeper")
        assert isinstance(mod, StandIn)
        from mindpulse_left_out_pkg.sub import Thing  # type: ignore[import-not-found]

        assert not isinstance(object(), Thing)

        class Sub(Thing):  # a base class at import time is fine
            pass

        with pytest.raises(LeftOut, match=rf"{name}.sub.Thing is not available.*without '{name}'"):
            Thing()
        with pytest.raises(LeftOut):
            mod.anything(1, key=2)
    assert not [m for m in sys.modules if m.startswith(name)], "stand-ins stayed in sys.modules"
    assert sys.modules["json"] is json
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)


LEAN = textwrap.dedent("""
    import json, sys
    pre = sys.argv[1:]
    for name in pre:
        __import__(name)
    from mindpulse.workers.lean_mindformers import LEFT_OUT, LeftOut, model_classes
    cfg_cls, model_cls = model_classes()
    loaded = [m for m in LEFT_OUT if m in sys.modules]
    from mindformers.core.metric import metric
    try:
        metric.sentence_bleu([["a"]], ["a"])
        bleu = "ran"
    except LeftOut as exc:
        bleu = str(exc)
    import jieba
    print(json.dumps({"model": model_cls.__module__ + "." + model_cls.__name__, "config": cfg_cls.__name__,
                      "loaded": loaded, "bleu": bleu,
                      "jieba_real": type(jieba).__name__ == "module" and callable(jieba.cut),
                      "metric_jieba_real": type(metric.jieba).__name__ == "module"}))
""")


def _lean(*pre: str) -> dict:
    env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    out = subprocess.run([sys.executable, "-c", LEAN, *pre], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh interpreters importing MindSpore and MindFormers
def test_the_recipe_gets_the_real_llama_without_the_left_out_packages():
    got = _lean()
    assert got["model"].endswith("LlamaForCausalLM") and got["config"] == "LlamaConfig", got
    assert got["loaded"] == [], f"MindFormers' import loaded {got['loaded']}"
    assert "sentence_bleu is not available" in got["bleu"] and "'nltk'" in got["bleu"], got
    # the user's own `import jieba` afterwards is the real package
    assert got["jieba_real"] and not got["metric_jieba_real"], got
    # a package imported before MindFormers is the real one in MindFormers too
    pre = _lean("jieba")
    assert pre["metric_jieba_real"], pre
