"""Built-in recipe: fine-tune a small MindFormers LLaMA on a byte-level text corpus.

Reads top to bottom like nanoGPT: context, data, model, optimizer, train. The model is
built from a config (no download); the base checkpoint it starts from is made by
`mindpulse pretrain` on a different corpus, so the demo is a real domain fine-tune.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mindpulse.config import RecipeConfig
from mindpulse.inputs.recipe_corpus import TRAIN_NAME, VALID_NAME, steps_per_epoch, too_small

if TYPE_CHECKING:
    from mindpulse.config.rank_settings import RankSettings

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent / "data"
TRAIN_FILE = DATA_DIR / TRAIN_NAME
VALID_FILE = DATA_DIR / VALID_NAME
PRETRAIN_FILE = DATA_DIR / "corpus_pretrain.txt"
BASE_CKPT = DATA_DIR / "base_llama_tiny.ckpt"
VOCAB = 256  # byte-level tokens


@dataclass
class ModelShape:
    """The recipe's model shape; its defaults are the config's (`job.recipe`)."""

    seq_length: int = RecipeConfig.seq_length
    hidden_size: int = RecipeConfig.hidden_size
    num_layers: int = RecipeConfig.num_layers
    num_heads: int = RecipeConfig.num_heads
    intermediate_size: int = RecipeConfig.intermediate_size


def llama_parameters(shape: ModelShape, vocab: int = VOCAB) -> int:
    """The recipe's LLaMA's trainable parameters: token embedding and untied output head
    (2·V·d), per block the four attention projections (4·d², as many key/value heads as
    query heads, no biases), the SwiGLU feed-forward's three matrices (3·d·ff) and two RMSNorm
    weights (2·d), and the final norm (d)."""
    d, ff = shape.hidden_size, shape.intermediate_size
    return 2 * vocab * d + shape.num_layers * (4 * d * d + 3 * d * ff + 2 * d) + d


def flops_per_token(shape: ModelShape, n_params: int | None = None) -> int:
    """Training FLOPs per token of the recipe's model: 6·N + 12·L·d·s (PaLM appendix B,
    Chinchilla appendix F: `mindpulse.workers.flops.decoder_flops_per_token`), N from
    `llama_parameters` unless the built model's own count is given."""
    from mindpulse.workers.flops import decoder_flops_per_token

    n = llama_parameters(shape) if n_params is None else n_params
    return decoder_flops_per_token(n, shape.num_layers, shape.hidden_size, shape.seq_length)


def read_tokens(path: Path) -> np.ndarray:
    data = Path(path).read_bytes()
    if len(data) < 2:
        raise ValueError(f"{path}: the corpus is empty; give a UTF-8 text file")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


class ByteWindows:
    """Iterable source of token windows (length seq_length + 1) for one rank.

    Each epoch the windows are shuffled with `seed + epoch` (the same order on every
    rank) and rank r takes every world-th one from offset r, so ranks see disjoint data.
    The stream is addressed by global step, so a resumed run continues at the exact data
    position: it yields the batches of steps `start_step + 1 .. stop_step`.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, rank: int, world: int, seed: int,
                 batch_size: int, start_step: int = 0, stop_step: int | None = None, skip_batches: int = 0):
        """`skip_batches`: step k trains on the batch of step k + skip_batches (a rollback
        skipped the batches from its checkpoint to the anomaly)."""
        self.tokens = tokens
        self.seq_length = seq_length
        self.rank, self.world, self.seed = rank, world, seed
        self.batch_size = batch_size
        small = too_small(len(tokens), seq_length, world, batch_size)
        if small:
            raise ValueError(small)
        self.steps_per_epoch = steps_per_epoch(len(tokens), seq_length, world, batch_size)
        self.n_windows = (len(tokens) - 1) // seq_length
        self.samples_per_epoch = self.steps_per_epoch * batch_size
        self.start_step = start_step
        self.stop_step = stop_step if stop_step is not None else self.steps_per_epoch
        self.skip_batches = max(0, skip_batches)
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return max(0, self.stop_step - self.start_step) * self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState(self.seed + epoch).permutation(self.n_windows)
                            [self.rank :: self.world][: self.samples_per_epoch]}
        return self._orders[epoch]

    def window(self, sample: int) -> np.ndarray:
        """The `sample`-th sample of this rank's stream (0-based, across epochs)."""
        epoch, pos = divmod(sample, self.samples_per_epoch)
        w = int(self._order(epoch)[pos])
        L = self.seq_length
        return self.tokens[w * L : w * L + L + 1].copy()

    def __iter__(self) -> Iterator[tuple[np.ndarray]]:
        skip = self.skip_batches * self.batch_size
        for i in range(self.start_step * self.batch_size, self.stop_step * self.batch_size):
            yield (self.window(i + skip),)


def eval_windows(tokens: np.ndarray, seq_length: int, rank: int, world: int) -> np.ndarray:
    """This rank's shard of the validation windows (fixed order)."""
    n = (len(tokens) - 1) // seq_length
    idx = np.arange(n)[rank::world]
    return np.stack([tokens[w * seq_length : w * seq_length + seq_length + 1] for w in idx]) if len(idx) else \
        np.zeros((0, seq_length + 1), np.int32)


def make_evaluator(model, windows: np.ndarray, batch_size: int, max_batches: int):
    """Mean next-byte loss over this rank's validation shard (and its perplexity).

    The model stays in training mode (it then returns the loss; LLaMA has no dropout),
    and no gradient is taken, so the weights are untouched."""
    import mindspore as ms

    n_batches = len(windows) // batch_size
    if max_batches:
        n_batches = min(n_batches, max_batches)

    def evaluate() -> dict[str, float]:
        if n_batches == 0:
            return {}
        losses = []
        for b in range(n_batches):
            out = model(ms.Tensor(windows[b * batch_size : (b + 1) * batch_size]))
            losses.append(float(out.asnumpy().reshape(-1).mean()))
        mean = float(np.mean(losses))
        return {"eval_loss": mean, "eval_ppl": float(math.exp(min(mean, 50.0)))}

    return evaluate


def build_model(shape: ModelShape, batch_size: int):
    from mindpulse.workers.lean_mindformers import model_classes

    LlamaConfig, LlamaForCausalLM = model_classes()  # noqa: N806 (classes)

    cfg = LlamaConfig(
        batch_size=batch_size,
        seq_length=shape.seq_length,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        vocab_size=VOCAB,
        intermediate_size=shape.intermediate_size,
        use_rope_slice=True,  # required on CPU
        fused_rms_norm=False,  # the fused RmsNorm kernel is not registered on CPU
        use_flash_attention=False,
        compute_dtype="float32",
        layernorm_compute_type="float32",
        softmax_compute_type="float32",
        rotary_dtype="float32",
        param_init_type="float32",
        pad_token_id=-100,  # every byte is a real token, nothing is masked
        ignore_token_id=-100,
    )
    return LlamaForCausalLM(cfg)


def lr_schedule(lr: float, warmup: int, total: int) -> list[float]:
    """Linear warm-up then cosine decay to 10%; constant when warmup == 0 and total small."""
    total = max(1, total)
    out = []
    for i in range(total):
        if warmup and i < warmup:
            out.append(lr * (i + 1) / warmup)
        elif warmup:
            t = (i - warmup) / max(1, total - warmup)
            out.append(lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))))
        else:
            out.append(lr)
    return out


def load_base(model, path: Path) -> None:
    import mindspore as ms

    if not Path(path).exists():
        raise FileNotFoundError(f"job.recipe.init_from: {path} does not exist; run `mindpulse pretrain` to make it")
    params = ms.load_checkpoint(str(path))
    not_loaded, _ = ms.load_param_into_net(model, params, strict_load=False)
    missing = [n for n in not_loaded if not n.startswith("mindpulse_")]
    if missing:
        raise ValueError(f"job.recipe.init_from: {path} lacks weights for {missing[:5]} (a different model shape?)")


def load_resume(train_net, path: str, kind: str = "") -> None:
    """Weights, optimizer moments and its global step (which indexes the lr schedule) from
    a checkpoint of either format, once this host has checked it against its manifest
    (size, sha256): a file that does not match is refused before MindSpore reads it."""
    import mindspore as ms

    from mindpulse.rundir.checkpoint_manifest import format_of, verify_for_load

    verify_for_load(path, kind)
    params = ms.load_checkpoint(str(path), format=format_of(path))
    params.pop("learning_rate", None)  # the schedule comes from this run's config (train.steps may grow)
    not_loaded, _ = ms.load_param_into_net(train_net, params, strict_load=False)
    missing = [n for n in not_loaded if not n.startswith("mindpulse_") and n != "learning_rate"]
    if missing:
        raise ValueError(f"resume: {path} lacks {missing[:5]}")


def set_mode(mode: str, device_target: str) -> None:
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE, device_target=device_target)


def main(settings: RankSettings) -> None:
    """Run in every rank by the launcher, with the run's settings (the recipe's options are
    in their resolved config)."""
    import mindspore as ms
    from mindspore import nn
    from mindspore.communication import get_group_size, get_rank, init
    from mindspore.train import Model

    from mindpulse.config import from_dict
    from mindpulse.workers.monitor import Monitor
    from mindpulse.workers.train_cell import MonitoredTrainOneStepCell

    cfg = from_dict(settings.config, source="job.json config")
    train, recipe = cfg.train, cfg.job.recipe
    if recipe is None:
        raise ValueError("job.recipe: this run's config gives job.script; the recipe does not run it")
    set_mode(train.mode.value, settings.device_target)
    distributed = "MS_ROLE" in os.environ or "RANK_SIZE" in os.environ and int(os.environ["RANK_SIZE"]) > 1
    if distributed:
        init()
        rank, size = get_rank(), get_group_size()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=size)
    else:
        rank, size = 0, 1
    ms.set_seed(train.seed)

    shape = ModelShape(**{k: getattr(recipe, k) for k in ModelShape.__dataclass_fields__})
    bs = train.batch_size
    tokens = read_tokens(Path(recipe.train_file or TRAIN_FILE))
    resume = settings.resume
    start = resume.step if resume is not None else 0
    source = ByteWindows(tokens, shape.seq_length, rank, size, train.seed, bs)
    total = train.steps or source.steps_per_epoch * train.epochs
    if start >= total:
        raise ValueError(f"resume: the checkpoint is at step {start}, the run has {total} steps; raise train.steps")
    skip = resume.skip_batches if resume is not None else 0
    if skip:
        log.info("[rank %d] rollback: skipping %d batch(es) of the data stream", rank, skip)
    source = ByteWindows(tokens, shape.seq_length, rank, size, train.seed, bs, start_step=start, stop_step=total,
                         skip_batches=skip)
    dataset = ms.dataset.GeneratorDataset(source, ["input_ids"], shuffle=False, num_parallel_workers=1,
                                          python_multiprocessing=False)
    dataset = dataset.batch(bs, drop_remainder=True)

    model = build_model(shape, bs)
    # mindformers' get_context may have switched the mode: set it again (measured quirk)
    set_mode(train.mode.value, settings.device_target)
    if recipe.init_from:
        load_base(model, Path(recipe.init_from))
    lrs = lr_schedule(train.lr, train.warmup_steps, total)
    if resume is not None and resume.lr_factor != 1.0:  # after a rollback, for `lr_steps` steps
        lrs = resume.scaled_lrs(lrs)
        log.info("[rank %d] rollback: learning rate x%g for steps %d..%d", rank, resume.lr_factor, start + 1,
                 resume.lr_until_step)
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=ms.Tensor(np.array(lrs, np.float32)),
                                   weight_decay=0.0)
    train_net = MonitoredTrainOneStepCell(model, optimizer)
    train_net.set_train()
    if resume is not None and resume.path:
        load_resume(train_net, resume.path, resume.kind)
        log.info("[rank %d] resumed from %s at step %d", rank, resume.path, start)
    evaluate = None
    if cfg.eval.every_steps or cfg.eval.per_epoch:
        valid = read_tokens(Path(recipe.valid_file or VALID_FILE))
        evaluate = make_evaluator(model, eval_windows(valid, shape.seq_length, rank, size), bs, cfg.eval.max_batches)
    # batch size, resume step and schedule come from the settings; the total is the
    # recipe's own when train.steps is 0 (the epochs decide)
    n_params = sum(int(p.size) for p in model.trainable_params())
    if n_params != llama_parameters(shape):
        log.warning("[rank %d] the model has %d trainable parameters, the recipe's formula says %d: FLOPs use %d",
                    rank, n_params, llama_parameters(shape), n_params)
    # every window is seq_length real tokens (no padding): tokens per step = seq_length x batch
    monitor = Monitor(total_steps=total, evaluate=evaluate, epoch_steps=source.steps_per_epoch, train_cell=train_net,
                      settings=settings, tokens_per_step=shape.seq_length * bs,
                      flops_per_token=flops_per_token(shape, n_params))
    log.info("[rank %d] model FLOPs per token %d (6N + 12·L·d·s, N = %d), %d tokens per step", rank,
             flops_per_token(shape, n_params), n_params, shape.seq_length * bs)
    log.info("[rank %d] steps %d..%d of %d (epochs of %d steps), world %d", rank, start + 1, total, total,
             source.steps_per_epoch, size)
    sink = train.dataset_sink_mode
    epochs = 1
    if sink and train.sink_size > 0:
        epochs = math.ceil((total - start) / train.sink_size)
    Model(train_net).train(epochs, dataset, callbacks=[monitor], dataset_sink_mode=sink, sink_size=train.sink_size)


def pretrain(out: Path, steps: int = 400, batch_size: int = 16, lr: float = 3e-3, seed: int = 7,
             shape: ModelShape | None = None, corpus: Path = PRETRAIN_FILE) -> dict[str, float]:
    """Single-process pretraining that makes the recipe's base checkpoint."""
    import mindspore as ms
    from mindspore import nn

    from mindpulse.workers.train_cell import MonitoredTrainOneStepCell, split_outputs

    shape = shape or ModelShape()
    set_mode("pynative", "CPU")
    ms.set_seed(seed)
    source = ByteWindows(read_tokens(corpus), shape.seq_length, 0, 1, seed, batch_size, stop_step=steps)
    model = build_model(shape, batch_size)
    set_mode("pynative", "CPU")
    lrs = lr_schedule(lr, max(1, steps // 20), steps)
    opt = nn.AdamWeightDecay(model.trainable_params(), learning_rate=ms.Tensor(np.array(lrs, np.float32)),
                             weight_decay=0.0)
    net = MonitoredTrainOneStepCell(model, opt)
    net.set_train()
    step, first, last = 0, None, None
    batch: list[np.ndarray] = []
    for (w,) in source:
        batch.append(w)
        if len(batch) == batch_size:
            loss, _ = split_outputs(net(ms.Tensor(np.stack(batch))))
            batch = []
            step += 1
            first = loss if first is None else first
            last = loss
            if step % 50 == 0 or step == 1:
                print(f"pretrain step {step}/{steps} loss {loss:.4f}", flush=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.ckpt")
    params = [{"name": p.name, "data": p} for p in model.get_parameters()]
    ms.save_checkpoint(params, str(tmp))
    os.chmod(tmp, 0o644)  # MindSpore writes 0400; the base checkpoint is shipped in the repo
    os.replace(tmp, out)
    return {"first_loss": float(first), "last_loss": float(last), "steps": steps}
