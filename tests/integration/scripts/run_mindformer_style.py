"""A user's own run_mindformer.py-style script: MindFormers' config, context and Trainer, no
mindpulse import (`--config X.yaml --use_parallel True`, as MindFormers' run_mindformer.py)."""

import argparse
import os

from mindformers.core.context import build_context
from mindformers.tools.register import MindFormerConfig
from mindformers.trainer import Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--use_parallel", default="False")
args = parser.parse_args()

config = MindFormerConfig(os.path.realpath(args.config))
config.use_parallel = args.use_parallel == "True"
if config.use_parallel:
    config.parallel_config.data_parallel = int(os.environ.get("RANK_SIZE", "1"))
build_context(config)
Trainer(config).train()
