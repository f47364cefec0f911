r"""The PyTorch peer of ``train.py`` for the end-to-end benchmark.

    /path/to/venv/bin/python benchmarks/torch_peer.py --data peer.npz \
        --config peer.json --out DIR

A plain ``torch.nn.TransformerEncoder`` (pre-LayerNorm, GELU, learned
positions, a final LayerNorm and a linear readout: the shape of
``mha.Transformer``) trained on the same arrays with the same schedule as
``train.py``'s config: the batch size and batch order (each epoch a
``np.random.default_rng([seed, epoch])`` permutation), AdamW with the same
peak learning rate, linear warmup and cosine decay, b2 and weight decay on the
Linear weights only, gradient clipping, and validation every
``eval_every_steps``. ``benchmarks/end_to_end_benchmark.py`` writes the data
(``.npz``: ``<split>_inputs``, ``<split>_targets``) and the config (JSON)
and spawns this script under its ``--peer_python``; it imports nothing of
``mha``, and torch is no dependency of ``mha``: any interpreter with torch
and NumPy runs it.

Writes ``DIR/metrics.jsonl`` as ``train.py`` does: first a row of the
peer's versions (``environment``: Python, torch, NumPy, torch's threads),
then a row at the end of the first step (``startup/seconds_since_process_start``), one per evaluation
(``validation/exact_match``, ``test/...`` at the end), and before each
evaluation the ``steps_per_sec`` of the steps since the last one (its time
left out, as in ``train.py``'s progress lines), each with ``time``.
"""

import time

_START = time.time()  # Before the imports, which the peer pays too.

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
from torch import nn


class Peer(nn.Module):
  """An encoder-only Transformer for per-position prediction."""

  def __init__(self, vocab_size: int, max_len: int, model: dict):
    super().__init__()
    d = model["d_model"]
    self.embed = nn.Embedding(vocab_size, d)
    nn.init.normal_(self.embed.weight, std=1.0)
    self.positions = nn.Parameter(0.5 * torch.randn(max_len, d))
    layer = nn.TransformerEncoderLayer(
        d, model["num_heads"], model["mlp_dim"], dropout=model["dropout_rate"],
        activation="gelu", batch_first=True, norm_first=model["pre_norm"])
    self.encoder = nn.TransformerEncoder(layer, model["num_layers"],
                                         enable_nested_tensor=False)
    self.norm = nn.LayerNorm(d) if model["pre_norm"] else nn.Identity()
    self.readout = nn.Linear(d, vocab_size)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    x = self.embed(tokens) + self.positions[:tokens.shape[1]]
    x = self.encoder(x, src_key_padding_mask=tokens == 0)
    return self.readout(self.norm(x))


def _schedule(config: dict):
  """Linear warmup from 0 to the peak, then cosine decay to 0 (optax's
  ``warmup_cosine_decay_schedule``), as a multiplier of the peak."""
  warmup = config["warmup_steps"]
  decay = max(config["num_train_steps"], warmup + 1)

  def factor(step: int) -> float:
    if step < warmup:
      return step / warmup
    progress = min(1.0, (step - warmup) / (decay - warmup))
    return 0.5 * (1 + math.cos(math.pi * progress))

  return factor


def _batch(n: int, seed: int, step: int, size: int) -> np.ndarray:
  """Indices of batch ``step``: windows over epoch permutations, as
  ``mha.data.train_batch`` draws them."""
  flat = step * size + np.arange(size)
  epochs, positions = np.divmod(flat, n)
  index = np.empty(size, np.int64)
  for epoch in np.unique(epochs):
    chosen = epochs == epoch
    index[chosen] = np.random.default_rng([seed, int(epoch)]).permutation(n)[
        positions[chosen]]
  return index


@torch.no_grad()
def _evaluate(model: Peer, inputs: torch.Tensor, targets: torch.Tensor,
              batch_size: int) -> dict:
  model.eval()
  correct = tokens = exact = sequences = 0
  loss_sum = 0.0
  for start in range(0, len(inputs), batch_size):
    x, y = inputs[start:start + batch_size], targets[start:start + batch_size]
    logits = model(x)
    valid = x != 0
    loss_sum += nn.functional.cross_entropy(
        logits[valid], y[valid], reduction="sum").item()
    right = (logits.argmax(-1) == y) & valid
    correct += right.sum().item()
    tokens += valid.sum().item()
    nonempty = valid.any(-1)
    exact += ((right | ~valid).all(-1) & nonempty).sum().item()
    sequences += nonempty.sum().item()
  model.train()
  return {"loss": loss_sum / max(tokens, 1),
          "token_accuracy": correct / max(tokens, 1),
          "exact_match": exact / max(sequences, 1)}


def _optimizer(model: Peer, config: dict) -> torch.optim.Optimizer:
  """AdamW, weight decay on the Linear weights only (as ``mha.build``)."""
  decayed = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
  decayed += [model.encoder.layers[i].self_attn.in_proj_weight
              for i in range(len(model.encoder.layers))]
  ids = {id(p) for p in decayed}
  rest = [p for p in model.parameters() if id(p) not in ids]
  return torch.optim.AdamW(
      [{"params": decayed, "weight_decay": config["weight_decay"]},
       {"params": rest, "weight_decay": 0.0}],
      lr=config["learning_rate"], betas=(0.9, config["adam_b2"]))


def train(arrays: dict, config: dict, out: str, start_time: float) -> None:
  """Trains the peer, writing ``out/metrics.jsonl``."""
  torch.manual_seed(config["seed"])
  split = lambda name: (torch.from_numpy(arrays[f"{name}_inputs"]).long(),
                        torch.from_numpy(arrays[f"{name}_targets"]).long())
  train_x, train_y = split("train")
  val_x, val_y = split("validation")
  model = Peer(config["vocab_size"], train_x.shape[1], config["model"])
  optimizer = _optimizer(model, config)
  scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "metrics.jsonl"), "w", encoding="utf-8") as f:
    write = lambda row: f.write(json.dumps({**row, "time": time.time()})
                                + "\n") or f.flush()
    write({"step": 0, "environment": {
        "python": sys.version.split()[0], "torch": torch.__version__,
        "numpy": np.__version__, "torch_threads": torch.get_num_threads()}})
    total = config["num_train_steps"]
    # Steps/s of each stretch between evaluations, timed as train.py's
    # progress lines are (the evaluations left out).
    window_start, window_time = 0, time.time()
    for step in range(1, total + 1):
      index = torch.from_numpy(_batch(len(train_x), config["seed"], step - 1,
                                      config["batch_size"]))
      x, y = train_x[index], train_y[index]
      valid = x != 0
      loss = nn.functional.cross_entropy(model(x)[valid], y[valid])
      optimizer.zero_grad(set_to_none=True)
      loss.backward()
      nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip_norm"])
      optimizer.step()
      scheduler.step()
      if step == 1:
        write({"step": 1, "startup/seconds_since_process_start":
               time.time() - start_time})
      if step % config["eval_every_steps"] == 0 or step == total:
        write({"step": step, "steps_per_sec": (step - window_start) / max(
            time.time() - window_time, 1e-9)})
        metrics = _evaluate(model, val_x, val_y, config["eval_batch_size"])
        write({"step": step,
               **{f"validation/{k}": v for k, v in metrics.items()}})
        window_start, window_time = step, time.time()
    metrics = _evaluate(model, *split("test"), config["eval_batch_size"])
    write({"step": total, **{f"test/{k}": v for k, v in metrics.items()}})
  print(f"peer: test exact match {metrics['exact_match']:.4f} after {total} "
        f"steps, {time.time() - start_time:.1f}s after start", flush=True)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", required=True, help=".npz of the splits")
  parser.add_argument("--config", required=True, help="JSON of the config")
  parser.add_argument("--out", required=True, help="output folder")
  args = parser.parse_args(argv)
  with open(args.config, encoding="utf-8") as f:
    config = json.load(f)
  with np.load(args.data) as arrays:
    train(dict(arrays), config, args.out, _START)


if __name__ == "__main__":
  main(sys.argv[1:])
