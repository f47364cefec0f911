"""The attention explorer: every head of a model in one self-contained HTML.

``python eval.py --workdir W --html`` writes ``W/eval/attention.html``, a
single file (script, styles and data inline; no network, no server) that
opens in any browser:

* a **model view**: layers x heads thumbnails of the selected example's
  attention; a click enlarges one, its tokens on the axes;
* a **head view**: one layer's heads as lines from each query token to the
  keys it attends to, heads toggled on and off, a colour per head;
* the example's input tokens, targets and predictions (wrong ones marked),
  and an example picker over ``num_examples`` examples, their lengths
  spread from the split's shortest to its longest;
* each head's roles (:mod:`mha.head_roles`) and, when the workdir holds a
  pruning study (``pruning/results.json``), its importance scores and the
  effect of removing it alone, on hover; for every example, the prediction
  with any one head removed (precomputed with head masks,
  :mod:`mha.pruning.core`).

The page is the template ``explorer.html`` (package data) with one JSON
payload put in. Attention weights travel as bytes (``round(255 w)``,
base64): the page shows them to 1/255.

    roles = head_roles.head_roles(ckpt.model, ckpt.params, split, 1000)
    explorer.write_explorer(ckpt.model, ckpt.params, split, "attention.html",
                            num_examples=8, roles=roles,
                            study=explorer.load_study("runs/reverse"))

In a notebook, :func:`show` returns the same page as an object that Jupyter
(and VS Code, Colab) displays inline: its ``_repr_html_`` is an ``<iframe
srcdoc="...">`` holding the page, HTML-escaped, so that the page's script and
styles run apart from the notebook's:

    explorer.show("runs/reverse")          # what eval.py --html writes
    explorer.show(model, params, split)    # any model and examples
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import html
import importlib.resources
import json
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha import data
from mha import evaluate
from mha import head_masks
from mha import head_roles as roles_lib
from mha.aliases import Array
from mha.model import Transformer
from mha.run import arguments


#: Where the pruning study writes its results, relative to the workdir.
STUDY_RESULTS = os.path.join("pruning", "results.json")
#: Importance measures shown per head: results.json key -> label.
IMPORTANCE_MEASURES = {
    "leave_one_out": "leave-one-out loss increase",
    "leave_one_out_token_accuracy_drop": "leave-one-out token acc. drop",
    "shapley_token_accuracy": "Shapley value (token acc.)",
    "gradient": "gradient |dL/dξ|",
    "gradient_l2": "gradient, L2 per layer",
    "confidence": "confidence (mean max weight)",
    "entropy": "entropy (nats)",
}
#: Single-head ablation results shown per head: key -> label.
ABLATION_MEASURES = {
    "token_accuracy_change": "Δ test token acc. removed alone",
    "exact_match_change": "Δ test exact match removed alone",
    "token_accuracy_q": "q-value (BH) of the token acc. change",
}
_PLACEHOLDER = "/*__PAYLOAD__*/null"


def _colours(cmap: str, count: int) -> list[str]:
  """``count`` hex colours of a matplotlib colour map."""
  from matplotlib import colormaps  # Deferred: only the page needs it.
  rgba = colormaps[cmap](np.linspace(0.0, 1.0, count) if count > 1 else
                         np.zeros(1))
  return ["#%02x%02x%02x" % tuple(int(round(255 * c)) for c in row[:3])
          for row in rgba]


def head_colours(num_heads: int) -> list[str]:
  """One colour per head: tab10 up to 10 heads, evenly spaced hues above."""
  if num_heads <= 10:
    from matplotlib import colormaps
    return ["#%02x%02x%02x" % tuple(int(round(255 * c)) for c in
                                    colormaps["tab10"](h)[:3])
            for h in range(num_heads)]
  return _colours("hsv", num_heads + 1)[:num_heads]


@functools.partial(jax.jit, static_argnames="model")
def _predict(model: Transformer, params: Any, inputs: Array):
  logits, attention = model.apply({"params": params}, inputs)
  return jnp.argmax(logits, -1), attention


@functools.partial(jax.jit, static_argnames="model")
def _ablated_predictions(model: Transformer, params: Any, inputs: Array,
                         masks: Array) -> Array:
  """``[M, B, L]``: the predictions with each head mask of ``masks``."""
  predict = lambda m: jnp.argmax(
      head_masks.masked_logits(model, params, inputs, m), -1)
  return jax.vmap(predict)(masks)


def _bytes(weights: np.ndarray) -> str:
  """Weights in ``[0, 1]`` as base64 of ``round(255 w)`` bytes."""
  quantised = np.clip(np.rint(np.asarray(weights) * 255.0), 0, 255)
  return base64.b64encode(quantised.astype(np.uint8).tobytes()).decode()


def _grid(value: Any) -> list[list[float | None]]:
  """An ``[L, H]`` array (or nested lists with None) as JSON-able lists."""
  rows = np.asarray(value, dtype=object).tolist()
  return [[None if v is None or not np.isfinite(float(v)) else
           float(f"{float(v):.4g}") for v in row] for row in rows]


def load_study(workdir: str) -> dict[str, Any] | None:
  """The per-head numbers of the pruning study in ``workdir`` (its first
  seed, the workdir's model), or None without ``pruning/results.json``.

  Raises:
    ValueError: that file does not read as a study's results (truncated,
      or a part missing).
  """
  path = os.path.join(workdir, STUDY_RESULTS)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      results = json.load(f)
    seed = results["seeds"][0]
    importance = {label: _grid(seed["importance"][key])
                  for key, label in IMPORTANCE_MEASURES.items()
                  if key in seed["importance"]}
    single = seed.get("single_head_ablation", {})
    ablation = {label: _grid(single[key])
                for key, label in ABLATION_MEASURES.items() if key in single}
    return {"step": int(seed["step"]), "seed": int(seed["seed"]),
            "importance_split": results["splits"]["importance"],
            "importance": importance, "ablation": ablation}
  except (OSError, ValueError, KeyError, IndexError, TypeError,
          AttributeError) as e:
    raise ValueError(f"{path} does not read as a pruning study's results "
                     f"({type(e).__name__}: {e}); move it aside or run the "
                     "study again") from None


def lower_triangle(weights: np.ndarray) -> np.ndarray:
  """``[..., n, n]`` -> ``[..., n (n + 1) / 2]``: each query's keys up to
  itself, query after query (what a causal head can attend to; the page's
  ``attention_layout`` ``"lower"``)."""
  n = weights.shape[-1]
  rows, cols = np.tril_indices(n)
  return weights[..., rows, cols]


def _example(index: int, split: data.Split, predictions: np.ndarray,
             attention: Sequence[np.ndarray], ablated: np.ndarray,
             row: int, causal: bool = False) -> dict[str, Any]:
  """One example of the payload, cropped to its valid length ``n``; a
  causal model's weights as their lower triangle (:func:`lower_triangle`),
  with the answer positions and the default window of queries shown."""
  n = int(split.lengths[index])
  heads = np.concatenate([a[row, :, :n, :n] for a in attention], axis=0)
  if causal:
    heads = lower_triangle(heads)
  targets = split.targets[index, :n]
  answers = evaluate.answer_positions(split, index)
  return {
      "index": int(index), "n": n,
      "inputs": split.inputs[index, :n].tolist(),
      "targets": targets.tolist(),
      "predictions": predictions[row, :n].tolist(),
      "attention": _bytes(heads),
      "ablated": ablated[:, row, :n].tolist(),
      "ablated_correct": np.sum(ablated[:, row, :n] == targets,
                                axis=-1).tolist(),
      "answers": None if answers is None else answers.tolist(),
      "window": list(evaluate.query_window(n, answers)),
  }


def build_payload(model: Transformer, params: Any, split: data.Split,
                  indices: Sequence[int], *,
                  roles: Mapping[str, Any] | None = None,
                  study: Mapping[str, Any] | None = None,
                  meta: Mapping[str, Any] | None = None,
                  token_names: Sequence[str] | None = None
                  ) -> dict[str, Any]:
  """The data of the page: the picked examples (``indices`` of ``split``)
  with their attention, predictions and predictions with each single head
  removed; the heads' ``roles`` (:func:`mha.head_roles.head_roles`), the
  pruning ``study`` (:func:`load_study`), and ``meta`` (run facts shown in
  the header: workdir, step, split, metrics).

  Sequences longer than :data:`mha.evaluate.WINDOW_FROM` are shown a window
  of :data:`mha.evaluate.WINDOW_SIZE` queries at a time (each example's
  ``window``, moved on the page); a causal model's weights travel as their
  lower triangle (``attention_layout`` ``"lower"``), the rest shown masked.
  ``token_names`` overrides ``data.token_names(split.task)`` (for a
  ``num_symbols`` other than 10)."""
  config = model.config
  causal = bool(getattr(config, "causal", False))
  if token_names is None and split.task:
    token_names = data.token_names(split.task)
  indices = np.asarray(indices, np.int64)
  inputs = jnp.asarray(split.inputs[indices])
  predictions, attention = jax.device_get(_predict(model, params, inputs))
  heads = list(config.heads_per_layer)
  if sum(heads):
    ablated = np.asarray(jax.device_get(_ablated_predictions(
        model, params, inputs,
        jnp.asarray(head_masks.leave_one_out_masks(config)))))
  else:  # No head to remove.
    ablated = np.zeros((0, *inputs.shape), np.int32)
  flat = [(layer, head) for layer, count in enumerate(heads)
          for head in range(count)]
  return {
      "meta": dict(meta or {}),
      "heads": heads,
      "head_colours": head_colours(max(heads, default=0)),
      "colormap": _colours("viridis", 256),
      "token_names": list(token_names) if token_names else None,
      "causal": causal,
      "attention_layout": "lower" if causal else "square",
      "window_size": evaluate.WINDOW_SIZE,
      "window_from": evaluate.WINDOW_FROM,
      "patterns": list(roles_lib.PATTERNS),
      "pattern_labels": roles_lib.LABELS,
      "roles": roles_lib.to_json(roles) if roles is not None else None,
      "top_roles": roles_lib.top_roles(roles) if roles is not None else None,
      "ablation_heads": [list(h) for h in flat],
      "study": dict(study) if study is not None else None,
      "examples": [_example(int(i), split, np.asarray(predictions),
                            [np.asarray(a) for a in attention], ablated, row,
                            causal)
                   for row, i in enumerate(indices)],
  }


def render(payload: Mapping[str, Any]) -> str:
  """The page: the template with ``payload`` inlined as JSON (``</`` escaped
  so that no string ends the script element)."""
  template = importlib.resources.files("mha").joinpath(
      "explorer.html").read_text(encoding="utf-8")
  text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
  text = text.replace("</", "<\\/").replace("<!--", "<\\!--")
  if template.count(_PLACEHOLDER) != 1:
    raise RuntimeError("explorer.html must hold the payload placeholder once")
  return template.replace(_PLACEHOLDER, text)


def _write_text(text: str, path: str) -> str:
  """Writes ``text`` to ``path`` (atomically: a temporary file renamed; no
  temporary file is left behind when that fails)."""
  if os.path.isdir(path):
    raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  temporary = path + ".tmp"
  try:
    with open(temporary, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(temporary, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(temporary)
    raise
  return path


def write_page(payload: Mapping[str, Any], path: str) -> str:
  """Writes :func:`render` of ``payload`` to ``path`` (atomically: a
  temporary file renamed); returns the path."""
  return _write_text(render(payload), path)


def explorer_payload(model: Transformer, params: Any, split: data.Split, *,
                     num_examples: int = 8,
                     roles: Mapping[str, Any] | None = None,
                     study: Mapping[str, Any] | None = None,
                     meta: Mapping[str, Any] | None = None,
                     token_names: Sequence[str] | None = None
                     ) -> dict[str, Any]:
  """The payload of ``num_examples`` examples of ``split``, their lengths
  spread from its shortest to its longest (see :func:`build_payload`).

  Raises:
    ValueError: ``num_examples`` below 1 or above the split's size.
  """
  if not 1 <= num_examples <= len(split):
    raise ValueError(f"num_examples must be in [1, {len(split)}], got "
                     f"{num_examples}")
  indices = evaluate.pick_examples(split, num_examples, shortest=True)
  indices = indices[np.argsort(split.lengths[indices], kind="stable")]
  return build_payload(model, params, split, indices, roles=roles,
                       study=study, meta=meta, token_names=token_names)


def write_explorer(model: Transformer, params: Any, split: data.Split,
                   path: str, *, num_examples: int = 8,
                   roles: Mapping[str, Any] | None = None,
                   study: Mapping[str, Any] | None = None,
                   meta: Mapping[str, Any] | None = None,
                   token_names: Sequence[str] | None = None) -> str:
  """Picks ``num_examples`` examples of ``split`` (lengths spread from its
  shortest to its longest) and writes their page to ``path``.

  Raises:
    ValueError: ``num_examples`` below 1 or above the split's size.
  """
  return write_page(explorer_payload(
      model, params, split, num_examples=num_examples, roles=roles,
      study=study, meta=meta, token_names=token_names), path)


def run_meta(workdir: str, task: str, step: int, split: str,
             metrics: Mapping[str, float]) -> dict[str, Any]:
  """The header facts of a workdir's page (what ``eval.py --html`` shows):
  the workdir, task, step, split and its loss and accuracies."""
  return {"workdir": workdir, "task": task, "step": int(step),
          "split": split, "metrics": {k: metrics[k] for k in (
              "loss", "token_accuracy", "exact_match")}}


class Explorer:
  """The explorer page, displayed inline by notebooks (:func:`show`).

  Attributes:
    page: the self-contained page, exactly what :func:`write_explorer`
      writes for the same arguments.
    height: the inline frame's height in CSS pixels.
  """

  def __init__(self, page: str, height: int = 900):
    self.page = page
    self.height = int(height)

  def _repr_html_(self) -> str:
    """The page in an ``<iframe srcdoc>``: its own document (scripts,
    styles, ids apart from the notebook's), the full width of the output."""
    return (f'<iframe srcdoc="{html.escape(self.page, quote=True)}" '
            f'title="attention explorer" style="width: 100%; '
            f'height: {self.height}px; border: 1px solid #ddd"></iframe>')

  def save(self, path: str) -> str:
    """Writes the page to ``path`` (atomically); returns the path."""
    return _write_text(self.page, path)


#: The split names :func:`show` takes with a workdir.
SPLIT_NAMES = ("train", "validation", "test")


def _check_show_arguments(params: Any, split: Any, step: Any,
                          num_examples: Any, height: Any) -> None:
  """Raises ValueError naming the first argument of :func:`show` that no
  call could take (before anything is loaded); the range of
  ``num_examples`` against the split's size is checked once it is known."""
  name = params if isinstance(params, str) else split
  if isinstance(name, str) and name not in SPLIT_NAMES:
    raise ValueError(f"split must be one of {', '.join(SPLIT_NAMES)}; got "
                     f"{name!r}")
  arguments.check_count("num_examples", num_examples)
  arguments.check_count("height", height, note="pixels")
  arguments.check_count("step", step, 0, none="the newest")


def show(source: str | os.PathLike | Transformer, params: Any = None,
         split: data.Split | str = "test", *, step: int | None = None,
         num_examples: int = 8, roles: Mapping[str, Any] | None = None,
         study: Mapping[str, Any] | None = None,
         meta: Mapping[str, Any] | None = None,
         height: int = 900,
         token_names: Sequence[str] | None = None) -> Explorer:
  """The explorer, for a notebook cell: ``show("runs/reverse")``,
  ``show("runs/reverse", "validation")`` or ``show(model, params, split)``.

  With a workdir, the page ``eval.py --workdir W --split S --step N --html``
  writes (``split`` names the split, ``step`` defaults to the newest): its
  metrics, the heads' roles and the pruning study if there is one. With a
  model, its ``params`` and a :class:`mha.data.Split`, the page of
  :func:`write_explorer` for the same arguments (``roles``, ``study``,
  ``meta`` and ``token_names`` as there; ``step`` unused).

  Returns:
    an :class:`Explorer`; a notebook shows it inline (``_repr_html_``),
    ``.page`` is the HTML, ``.save(path)`` writes it.

  Raises:
    ValueError: ``num_examples`` out of range, a split name that is not
      ``train``, ``validation`` or ``test``, a ``height`` or ``step`` that
      is not a positive (for ``step``: non-negative) int, or the arguments
      of neither form; all before anything is loaded or computed.
    FileNotFoundError: the workdir has no checkpoint (or not ``step``).
  """
  _check_show_arguments(params, split, step, num_examples, height)
  if isinstance(source, Transformer):
    if params is None or not isinstance(split, data.Split):
      raise ValueError("show(model, params, split) needs the parameters and "
                       "a mha.data.Split")
    payload = explorer_payload(source, params, split,
                               num_examples=num_examples, roles=roles,
                               study=study, meta=meta,
                               token_names=token_names)
    return Explorer(render(payload), height)
  if isinstance(source, (str, os.PathLike)) and isinstance(params, str):
    if split != "test":
      raise ValueError(f"show({os.fspath(source)!r}, {params!r}, ...): the "
                       "split is given twice")
    params, split = None, params  # show(workdir, "validation")
  if not isinstance(source, (str, os.PathLike)) or params is not None or \
      not isinstance(split, str):
    raise ValueError(
        "show takes a workdir and a split's name, or a model, its params "
        f"and a Split; got ({type(source).__name__}, "
        f"{type(params).__name__}, {type(split).__name__})")
  from mha import build  # Deferred: checkpoints pull in orbax.
  from mha import checkpoint
  workdir = os.fspath(source)
  ckpt = checkpoint.load_checkpoint(workdir, step)
  config = ckpt.config
  examples = data.load_splits(build.data_spec(config),
                              config.data.data_dir)[split]
  metrics = evaluate.evaluate(ckpt.model, ckpt.params, examples,
                              config.eval_batch_size)
  payload = explorer_payload(
      ckpt.model, ckpt.params, examples, num_examples=num_examples,
      roles=roles_lib.head_roles(ckpt.model, ckpt.params, examples,
                                 config.eval_batch_size),
      study=load_study(workdir),
      meta=run_meta(workdir, config.task, ckpt.step, split, metrics),
      token_names=data.token_names(config.task, config.data.num_symbols))
  return Explorer(render(payload), height)


__all__ = ["STUDY_RESULTS", "IMPORTANCE_MEASURES", "ABLATION_MEASURES",
           "head_colours", "load_study", "build_payload", "render",
           "write_page", "explorer_payload", "write_explorer", "run_meta",
           "Explorer", "show", "lower_triangle"]
