"""The attention explorer (mha.explorer, eval.py --html), tested in headless
Chromium driven over the DevTools protocol."""

from __future__ import annotations

import base64
import fcntl
import html.parser
import io
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pytest

from conftest import ROOT, copy_workdir, start
from mha import build
from mha import checkpoint
from mha import data
from mha import explorer
from mha import head_roles

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-quic", "--no-first-run",
                  "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--remote-debugging-pipe")


def chromium_path() -> str | None:
  """The Chromium executable, if installed."""
  for name in ("chromium", "chromium-browser", "google-chrome"):
    path = shutil.which(name)
    if path:
      return path
  return None


class Browser:
  """Headless Chromium over the DevTools protocol on a pipe (fd 3 in, fd 4
  out, each message JSON ended by a NUL byte): no driver to install."""

  def __init__(self, executable: str, width: int = 1400, height: int = 1000,
               timeout: float = 120.0):
    # A bound against a hung browser, not a measure: a first start beside
    # two test workers compiling can take many seconds.
    self.timeout = timeout
    self._profile = tempfile.mkdtemp(prefix="chromium-")
    read_end, self._to_chrome = os.pipe()
    self._from_chrome, write_end = os.pipe()
    # Chromium's ends, above 9 (clear of fds 3 and 4); bash makes them fds 3
    # and 4 of Chromium (no Python runs in the forked child: JAX's threads
    # make that unsafe).
    ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (read_end,
                                                          write_end)]
    os.close(read_end)
    os.close(write_end)
    try:
      self._process = subprocess.Popen(
          ["/bin/bash", "-c", f'exec "$0" "$@" 3<&{ends[0]} 4>&{ends[1]} '
           f'{ends[0]}<&- {ends[1]}>&-',
           executable, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}",
           f"--window-size={width},{height}", "about:blank"],
          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
          stderr=subprocess.DEVNULL, pass_fds=ends)
    finally:
      for fd in ends:
        os.close(fd)
    self._buffer = b""
    self._next_id = 0
    self.events: list[dict[str, Any]] = []
    self.session: str | None = None
    try:
      target = self.send("Target.createTarget", {"url": "about:blank"},
                         session=False)["targetId"]
      self.session = self.send("Target.attachToTarget", {
          "targetId": target, "flatten": True}, session=False)["sessionId"]
      for domain in ("Page", "Runtime", "Network", "Log"):
        self.send(f"{domain}.enable")
      self.send("Emulation.setDeviceMetricsOverride", {
          "width": width, "height": height, "deviceScaleFactor": 1,
          "mobile": False})
    except BaseException:
      self.close()
      raise

  def _read_message(self, deadline: float) -> dict[str, Any]:
    while b"\0" not in self._buffer:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
        raise TimeoutError("Chromium did not answer in time")
      chunk = os.read(self._from_chrome, 1 << 20)
      if not chunk:
        raise ConnectionError("Chromium closed the DevTools pipe")
      self._buffer += chunk
    message, self._buffer = self._buffer.split(b"\0", 1)
    return json.loads(message)

  def send(self, method: str, params: dict[str, Any] | None = None, *,
           session: bool = True) -> dict[str, Any]:
    """Sends a command and waits for its result (events seen meanwhile are
    kept in ``events``)."""
    self._next_id += 1
    message = {"id": self._next_id, "method": method, "params": params or {}}
    if session and self.session:
      message["sessionId"] = self.session
    os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
    deadline = time.monotonic() + self.timeout
    while True:
      reply = self._read_message(deadline)
      if reply.get("id") == self._next_id:
        if "error" in reply:
          raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]
      self.events.append(reply)

  def wait_for_event(self, method: str) -> dict[str, Any]:
    """The first event ``method`` (already seen, or the next one)."""
    deadline = time.monotonic() + self.timeout
    seen = [e for e in self.events if e.get("method") == method]
    while not seen:
      event = self._read_message(deadline)
      self.events.append(event)
      if event.get("method") == method:
        seen.append(event)
    return seen[0]

  def open(self, path: str) -> None:
    """Loads a local file and waits for its load event."""
    self.send("Page.navigate", {"url": "file://" + os.path.abspath(path)})
    self.wait_for_event("Page.loadEventFired")

  def js(self, expression: str) -> Any:
    """The value of a JavaScript expression in the page."""
    result = self.send("Runtime.evaluate", {"expression": expression,
                                            "returnByValue": True})
    if "exceptionDetails" in result:
      raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
    return result["result"].get("value")

  def _centre(self, selector: str) -> list[float]:
    return self.js(f"""(() => {{ const r = document.querySelector({
        json.dumps(selector)}).getBoundingClientRect();
        return [r.left + r.width / 2, r.top + r.height / 2]; }})()""")

  def hover(self, selector: str) -> None:
    """Moves the mouse to the element's centre."""
    x, y = self._centre(selector)
    self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x,
                                           "y": y})

  def click(self, selector: str) -> None:
    """A real mouse click (press and release) at the element's centre."""
    x, y = self._centre(selector)
    for kind in ("mousePressed", "mouseReleased"):
      self.send("Input.dispatchMouseEvent", {
          "type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

  def screenshot(self) -> bytes:
    """A PNG of the whole page."""
    return base64.b64decode(self.send("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True})["data"])

  def close(self) -> None:
    try:
      self.send("Browser.close", session=False)
      self._process.wait(timeout=10)
    except (OSError, RuntimeError, TimeoutError, ConnectionError,
            subprocess.TimeoutExpired):
      self._process.kill()
      self._process.wait()
    for fd in (self._to_chrome, self._from_chrome):
      os.close(fd)
    shutil.rmtree(self._profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
  """Headless Chromium, or the test skipped with the reason it cannot run."""
  executable = chromium_path()
  if executable is None:
    pytest.skip("no Chromium installed (Debian: apt-get install chromium)")
  try:
    session = Browser(executable)
  except (OSError, RuntimeError, TimeoutError, ConnectionError) as e:
    pytest.skip(f"headless Chromium does not start here: {e}")
  yield session
  session.close()


# --------------------------------------------------------------------------
# The page.
# --------------------------------------------------------------------------


def _fake_study(workdir: str, step: int, grid=None) -> None:
  """A ``pruning/results.json`` with the keys the explorer reads, as
  ``mha.pruning.study`` writes them (its tests pin them; running the
  study here would cost seconds): per-head values 0.1 * (layer * 2 + head),
  None (NaN) for the first head's Shapley value."""
  grid = grid or [[0.0, 0.1], [0.2, 0.3]]
  importance = {k: grid for k in (
      "gradient", "gradient_l2", "leave_one_out", "confidence", "entropy",
      "leave_one_out_token_accuracy_drop")}
  importance["shapley_token_accuracy"] = [[None, *grid[0][1:]], *grid[1:]]
  single = {k: grid for k in ("token_accuracy_change", "token_accuracy_q",
                              "exact_match_change")}
  results = {"splits": {"importance": "validation", "accuracy": "test"},
             "seeds": [{"seed": 0, "step": step, "importance": importance,
                        "single_head_ablation": single}]}
  os.makedirs(os.path.join(workdir, "pruning"))
  with open(os.path.join(workdir, explorer.STUDY_RESULTS), "w",
            encoding="utf-8") as f:
    json.dump(results, f)


@pytest.fixture(scope="module")
def page_arguments(tiny_run, tmp_path_factory):
  """What the page of the tiny run is made of: ``(workdir, (model, params,
  split), keyword arguments)``; 4 test examples and a pruning study."""
  workdir = copy_workdir(tiny_run.workdir,
                         tmp_path_factory.mktemp("explorer") / "run")
  _fake_study(workdir, step=20)
  ckpt = checkpoint.load_checkpoint(workdir)
  split = data.load_splits(build.data_spec(ckpt.config),
                           ckpt.config.data.data_dir)["test"]
  roles = head_roles.head_roles(ckpt.model, ckpt.params, split, 64)
  return workdir, (ckpt.model, ckpt.params, split), dict(
      num_examples=4, roles=roles, study=explorer.load_study(workdir),
      meta={"task": ckpt.config.task, "step": ckpt.step, "split": "test"})


@pytest.fixture(scope="module")
def page(page_arguments):
  """The explorer of the tiny run: ``(path, workdir)``."""
  workdir, args, kwargs = page_arguments
  path = explorer.write_explorer(
      *args, os.path.join(workdir, "eval", "attention.html"), **kwargs)
  return path, workdir


def _payload(path: str) -> dict[str, Any]:
  with open(path, encoding="utf-8") as f:
    html = f.read()
  start = html.index('id="payload">') + len('id="payload">')
  return json.loads(html[start:html.index("</script>", start)])


def _is_not_blank(png: bytes) -> None:
  from matplotlib import image
  pixels = image.imread(io.BytesIO(png), format="png")[..., :3]
  rgb = (pixels.reshape(-1, 3) * 255).astype(np.uint32)
  # One int per colour: np.unique of rows (axis=0) took 1.5 s a screenshot.
  colours = np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2])
  assert len(colours) > 50, "screenshot looks blank"
  assert pixels.std() > 0.05


def _tokens(browser: Browser) -> list[str]:
  return browser.js("[...document.querySelectorAll('#tokens td.token')]"
                    ".map(t => t.textContent)")


def _assert_no_script_errors(browser: Browser) -> None:
  errors = [e for e in browser.events if e.get("method") in (
      "Runtime.exceptionThrown", "Log.entryAdded") and (
          e["method"] == "Runtime.exceptionThrown" or
          e["params"]["entry"]["level"] == "error")]
  assert not errors, errors


def test_page_in_a_real_browser(page, browser):
  path, _ = page
  browser.open(path)
  assert browser.js("document.body.dataset.ready") == "1"
  _assert_no_script_errors(browser)
  # Nothing but the file itself was requested (no network, no CDN).
  urls = [e["params"]["request"]["url"] for e in browser.events
          if e.get("method") == "Network.requestWillBeSent"]
  assert urls and all(u.startswith(("file:", "data:")) for u in urls), urls
  assert browser.js("document.querySelectorAll('canvas.thumb').length") == 4
  payload = browser.js("P")  # tiny: 2 layers x 2 heads, above
  first, second = payload["examples"][:2]
  assert _tokens(browser) == [str(t) for t in first["inputs"]]
  wrong = sum(p != t for p, t in zip(first["predictions"], first["targets"]))
  assert browser.js(
      "document.querySelectorAll('#tokens td.wrong').length") == wrong
  assert browser.js(
      "document.querySelectorAll('#study-table tr').length") == 5
  assert browser.js(
      "document.querySelectorAll('#roles-table tr').length") == 5
  shot_before = browser.screenshot()
  _is_not_blank(shot_before)
  # Another example: its tokens, another picture in every thumbnail.
  thumb = "canvas.thumb[data-layer='1'][data-head='0']"
  pixels = f"document.querySelector(\"{thumb}\").toDataURL()"
  before = browser.js(pixels)
  browser.click("#next-example")
  assert browser.js("document.getElementById('example-select').value") == "1"
  assert _tokens(browser) == [str(t) for t in second["inputs"]]
  assert browser.js(pixels) != before
  # Hovering a head shows its roles and the study's numbers (layer 1,
  # head 0: 0.2 in every fake measure).
  browser.hover(thumb)
  tip = browser.js("document.getElementById('tooltip').textContent")
  assert tip.startswith("layer 1, head 0") and "anti-diagonal" in tip
  assert "leave-one-out loss increase0.200" in tip
  # Enlarge a head with a click; hide a head in the head view.
  browser.click(thumb)
  assert browser.js("document.getElementById('enlarged-title').textContent"
                    ).startswith("layer 1, head 0")
  drawn = "[...document.querySelectorAll('line.attn')]"
  lines = browser.js(f"{drawn}.length")
  assert lines > 0 and browser.js(
      f"new Set({drawn}.map(l => l.dataset.head)).size") == 2
  browser.click(".head-toggle[data-head='0']")
  assert browser.js(f"{drawn}.every(l => l.dataset.head === '1')")
  assert 0 < browser.js(f"{drawn}.length") < lines
  # Remove a head: its predictions appear as a row of their own.
  browser.js("const s = document.getElementById('ablate-select');"
             "s.value = '2'; s.dispatchEvent(new Event('change'))")
  assert browser.js("document.querySelectorAll('#tokens tr.ablated td')"
                    ".length") == second["n"]
  shot_after = browser.screenshot()
  _is_not_blank(shot_after)
  assert shot_after != shot_before
  with open(os.environ.get("EXPLORER_SCREENSHOT", os.devnull), "wb") as f:
    f.write(shot_after)


class _Srcdoc(html.parser.HTMLParser):
  """The ``srcdoc`` of each iframe, unescaped as a browser reads it."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.found: list[str] = []

  def handle_starttag(self, tag, attrs):
    if tag == "iframe":
      self.found.append(dict(attrs)["srcdoc"])


def test_show_in_a_notebook_cell(page, page_arguments, browser, tmp_path):
  """``show(model, params, split)`` is the page write_explorer wrote, in an
  iframe that runs it inside a host page (as a notebook's output would)."""
  path, _ = page
  _, args, kwargs = page_arguments
  view = explorer.show(*args, **kwargs)
  with open(path, encoding="utf-8") as f:
    assert view.page == f.read()
  cell = view._repr_html_()
  parser = _Srcdoc()
  parser.feed(cell)
  assert parser.found == [view.page]  # escaped right: it reads back exactly
  assert "<script" not in cell and "</script" not in cell
  host = tmp_path / "notebook.html"
  host.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'>"
                  "<title>notebook</title></head><body><pre>In [1]: "
                  "explorer.show(model, params, split)</pre>"
                  f"<div class='output'>{cell}</div></body></html>",
                  encoding="utf-8")
  browser.events.clear()
  browser.open(str(host))
  inner = "document.querySelector('iframe').contentDocument"
  assert browser.js(f"{inner}.body.dataset.ready") == "1"
  _assert_no_script_errors(browser)
  first, second = _payload(path)["examples"][:2]
  tokens = (f"[...{inner}.querySelectorAll('#tokens td.token')]"
            ".map(t => t.textContent)")
  assert browser.js(tokens) == [str(t) for t in first["inputs"]]
  assert browser.js(f"{inner}.querySelectorAll('canvas.thumb').length") == 4
  browser.js(f"{inner}.getElementById('next-example').click()")
  assert browser.js(tokens) == [str(t) for t in second["inputs"]]
  shot = browser.screenshot()
  _is_not_blank(shot)
  with open(os.environ.get("NOTEBOOK_SCREENSHOT", os.devnull), "wb") as f:
    f.write(shot)


def test_show_a_workdir(page, page_arguments, tmp_path, monkeypatch):
  """docs/explorer.md's block, ``show(workdir)``: eval.py's page (its
  metrics and roles, the study) of 8 examples."""
  path, workdir = page
  model = page_arguments[1][0]
  with open(os.path.join(ROOT, "docs", "explorer.md"), encoding="utf-8") as f:
    [block] = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  (tmp_path / "runs").mkdir()
  (tmp_path / "runs" / "reverse").symlink_to(workdir)
  monkeypatch.chdir(tmp_path)
  namespace: dict = {}
  exec(compile(block, "docs/explorer.md", "exec"), namespace)
  page_text = namespace["view"].page
  start = page_text.index('id="payload">') + len('id="payload">')
  payload = json.loads(page_text[start:page_text.index("</script>", start)])
  written = _payload(path)
  assert len(payload["examples"]) == 8
  assert payload["study"] == written["study"] and payload["study"]
  assert payload["roles"] == written["roles"]
  meta = payload["meta"]
  assert (meta["workdir"], meta["task"], meta["step"], meta["split"]) == (
      "runs/reverse", "reverse", 20, "test")
  assert set(meta["metrics"]) == {"loss", "token_accuracy", "exact_match"}
  with pytest.raises(ValueError, match="needs the parameters"):
    explorer.show(model)
  with pytest.raises(ValueError, match="a workdir and a split's name"):
    explorer.show(42)
  # The docs' second form: the split's name second (it used to be taken
  # for the parameters and refused).
  other = explorer.show("runs/reverse", "validation", step=10, num_examples=3)
  start = other.page.index('id="payload">') + len('id="payload">')
  payload = json.loads(other.page[start:other.page.index("</script>", start)])
  assert (payload["meta"]["split"], payload["meta"]["step"]) == (
      "validation", 10)
  assert len(payload["examples"]) == 3
  with pytest.raises(ValueError, match="the split is given twice"):
    explorer.show("runs/reverse", "validation", split="test2")


def test_payload_matches_the_model(page, tiny_run):
  import jax
  path, workdir = page
  payload = _payload(path)
  ckpt = checkpoint.load_checkpoint(workdir)
  split = data.load_splits(build.data_spec(ckpt.config),
                           ckpt.config.data.data_dir)["test"]
  lengths = [e["n"] for e in payload["examples"]]
  # Short and long: from the split's shortest to its longest, in order.
  assert len(lengths) == 4 and lengths == sorted(lengths)
  assert (lengths[0], lengths[-1]) == (split.lengths.min(),
                                       split.lengths.max())
  e = payload["examples"][-1]
  n = e["n"]
  tokens = split.inputs[e["index"]][None]
  weights = np.frombuffer(base64.b64decode(e["attention"]), np.uint8)
  mask = np.ones((2, 2), np.float32)
  mask[1, 0] = 0.0

  # Both references jitted, one program (op by op, each of the model's
  # operations compiled on its own), and sliced on the host.
  @jax.jit
  def references(params, tokens, mask):
    _, attention = ckpt.model.apply({"params": params}, tokens)
    logits, _ = ckpt.model.apply({"params": params}, tokens, head_mask=mask)
    return attention, logits
  attention, logits = jax.device_get(references(ckpt.params, tokens, mask))
  expected = np.concatenate([a[0, :, :n, :n] for a in attention])
  # Bytes round(255 w): within half a step (and float32 rounding).
  np.testing.assert_allclose(weights.reshape(4, n, n) / 255.0, expected,
                             atol=0.5 / 255 + 1e-6)
  # Removing one head: what the head mask gives.
  assert e["ablated"][payload["ablation_heads"].index([1, 0])] == \
      np.argmax(logits[0, :n], -1).tolist()
  study = payload["study"]
  assert study["step"] == 20 and study["importance"][
      "Shapley value (token acc.)"] == [[None, 0.1], [0.2, 0.3]]
  assert payload["top_roles"] == head_roles.top_roles(
      {p: np.asarray(v, np.float64) for p, v in payload["roles"].items()})


def test_page_size_of_the_default_model(tmp_path):
  """8 examples of the default model (2 layers x 4 heads, length 16) with
  its roles and a pruning study stay under 2 MB. The page's size depends on
  shapes only: zero parameters (no compilation to initialise them)."""
  import jax
  from configs import default
  model = build.make_model(default.get_config())
  params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(
      lambda: build.init_params(model, jax.random.key(0))))
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, 11, size=(8, 16)).astype(np.int32)
  split = data.Split(inputs=inputs, targets=inputs[:, ::-1].copy(),
                     task="reverse")
  grid = np.full((2, 4), 0.123456789)
  _fake_study(str(tmp_path), step=500, grid=grid.tolist())
  path = explorer.write_explorer(
      model, params, split, str(tmp_path / "a.html"), num_examples=8,
      roles={p: grid for p in head_roles.PATTERNS},
      study=explorer.load_study(str(tmp_path)))
  assert os.path.getsize(path) < 2 * 1024 * 1024
  payload = _payload(path)
  assert len(payload["examples"]) == 8
  assert len(payload["study"]["importance"]) == 7


def test_eval_script_bad_input(tiny_run, tmp_path, subprocess_env):
  workdir = copy_workdir(tiny_run.workdir, tmp_path / "run")
  empty = tmp_path / "empty"
  empty.mkdir()
  # A study cut short (a truncated results.json): read before any work.
  studied = copy_workdir(tiny_run.workdir, tmp_path / "studied")
  os.makedirs(os.path.join(studied, "pruning"))
  with open(os.path.join(studied, "pruning", "results.json"), "w",
            encoding="utf-8") as f:
    f.write('{"seeds": [')
  # A folder where the page goes.
  blocked = copy_workdir(tiny_run.workdir, tmp_path / "blocked")
  os.makedirs(os.path.join(blocked, "eval", "attention.html"))
  cases = (
      ([f"--workdir={blocked}", "--html"],
       f"eval.py: error: {blocked}/eval/attention.html is a folder, where "
       "--html writes the explorer page: move it aside"),
      ([f"--workdir={studied}", "--html"],
       f"eval.py: error: {studied}/pruning/results.json does not read as a "
       "pruning study's results (JSONDecodeError: Expecting value: line 1 "
       "column 12 (char 11)); move it aside or run the study again"),
      ([f"--workdir={workdir}", "--html", "--examples=0"],
       "eval.py: error: --examples must be at least 1, got 0"),
      ([f"--workdir={workdir}", "--html", "--examples=65"],
       "eval.py: error: --examples=65 is more than the 64 examples of the "
       "test split"),
      ([f"--workdir={workdir}", "--examples=3"],
       "eval.py: error: --examples needs --html"),
      ([f"--workdir={empty}", "--html"],
       f"eval.py: error: no checkpoints in {empty} ({empty}/checkpoints "
       "does not exist)"),
  )
  procs = [start([sys.executable, os.path.join(ROOT, "eval.py"), *args],
                 env=subprocess_env) for args, _ in cases]
  for proc, (_, message) in zip(procs, cases):
    result = proc.wait()
    stderr = result.stderr
    assert result.returncode == 2, stderr
    assert stderr.strip().splitlines() == [message]
  assert not os.path.exists(os.path.join(workdir, "eval"))
  assert os.listdir(empty) == []
  assert not os.path.exists(os.path.join(studied, "eval"))
  assert os.listdir(os.path.join(blocked, "eval")) == ["attention.html"]
  with pytest.raises(IsADirectoryError):  # the library's own check
    explorer.write_page({}, os.path.join(blocked, "eval", "attention.html"))
  assert os.listdir(os.path.join(blocked, "eval")) == ["attention.html"]


# --------------------------------------------------------------------------
# A causal model at 256 tokens: a window of queries, the lower triangle.
# --------------------------------------------------------------------------


def _passkey_split(config, num: int) -> data.Split:
  """``num`` passkey examples of ``config``'s data spec (generated in
  memory: no TFDS folder to prepare)."""
  records = data._passkey_tokens(np.random.default_rng(0),
                                 build.data_spec(config), num)
  return data.causal_split(records, "passkey")


@pytest.fixture(scope="module")
def causal_page(tmp_path_factory):
  """The page of ``tiny,passkey`` (2 layers x 2 causal heads, context 256)
  at its initial parameters, 4 examples: ``(path, model, params, split)``."""
  import jax
  from configs import default
  config = default.get_config("tiny,passkey")
  model = build.make_model(config)
  # Jitted: eagerly each op of the initialisation compiles alone.
  params = jax.jit(build.init_params, static_argnums=0)(model,
                                                         jax.random.key(0))
  split = _passkey_split(config, 8)
  path = explorer.write_explorer(
      model, params, split, str(tmp_path_factory.mktemp("causal") /
                                "attention.html"), num_examples=4)
  return path, model, params, split


def test_query_window():
  from mha import evaluate
  assert evaluate.query_window(16) == (0, 16)  # Short: whole.
  assert evaluate.query_window(64) == (0, 64)
  assert evaluate.query_window(256) == (224, 256)  # No answers: the end.
  # Ending two positions after the last answer, within the sequence.
  assert evaluate.query_window(256, [251, 252, 253, 254, 255]) == (224, 256)
  assert evaluate.query_window(256, [40, 100]) == (71, 103)
  assert evaluate.query_window(256, [3]) == (0, 32)
  assert evaluate.query_window(128, None, size=16) == (112, 128)


@pytest.mark.slow
def test_causal_payload_at_256_tokens(causal_page):
  """A causal model's payload: its weights as their lower triangle (what
  the model gives, to 1/255), the answers and the window around them."""
  import jax
  path, model, params, split = causal_page
  payload = _payload(path)
  assert payload["causal"] is True
  assert payload["attention_layout"] == "lower"
  assert (payload["window_size"], payload["window_from"]) == (32, 64)
  assert payload["token_names"][:3] == ["", "KEY", "ASK"]
  for e in payload["examples"]:
    n = e["n"]
    assert n == 256
    # passkey: the 5 digits recalled at the end are the answers.
    assert e["answers"] == [251, 252, 253, 254, 255]
    assert e["window"] == [224, 256]
    assert len(base64.b64decode(e["attention"])) == 4 * n * (n + 1) // 2
  e = payload["examples"][-1]
  weights = np.frombuffer(base64.b64decode(e["attention"]), np.uint8)
  _, attention = jax.jit(model.apply)({"params": params},
                                      split.inputs[e["index"]][None])
  heads = np.concatenate([np.asarray(a)[0] for a in attention])
  assert np.all(np.triu(heads, 1) == 0)  # Causal: nothing above.
  np.testing.assert_allclose(
      weights.reshape(4, -1) / 255.0, explorer.lower_triangle(heads),
      atol=0.5 / 255 + 1e-6)


@pytest.mark.slow
def test_page_size_of_the_passkey_model(tmp_path):
  """8 examples of ``:passkey`` (2 layers x 4 causal heads, 256 tokens)
  stay under 3 MB: each head's 256 x 256 weights as their lower triangle of
  bytes (zero parameters: the size depends on shapes only)."""
  import jax
  from configs import default
  config = default.get_config("passkey")
  model = build.make_model(config)
  params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(
      lambda: build.init_params(model, jax.random.key(0))))
  path = explorer.write_explorer(model, params, _passkey_split(config, 16),
                                 str(tmp_path / "a.html"), num_examples=8)
  assert os.path.getsize(path) < 3 * 1024 * 1024, os.path.getsize(path)
  payload = _payload(path)
  assert len(payload["examples"]) == 8
  assert {len(base64.b64decode(e["attention"]))
          for e in payload["examples"]} == {8 * 256 * 257 // 2}


def _grey(browser: Browser, selector: str, x: int, y: int) -> list[int]:
  return browser.js(f"""[...document.querySelector({json.dumps(selector)})
      .getContext('2d').getImageData({x}, {y}, 1, 1).data].slice(0, 3)""")


@pytest.mark.slow
def test_causal_page_in_a_real_browser(causal_page, page, browser):
  """256 tokens of a causal model: the page shows a window of 32 queries,
  the slider and the buttons move it, masked keys are grey; no script
  error. The encoder page (16 tokens at most) shows no window."""
  path, *_ = causal_page
  browser.events.clear()
  browser.open(path)
  assert browser.js("document.body.dataset.ready") == "1"
  _assert_no_script_errors(browser)
  payload = _payload(path)
  names = payload["token_names"]
  first = payload["examples"][0]
  controls = "document.getElementById('window-controls')"
  assert browser.js(f"{controls}.classList.contains('hidden')") is False
  # The window: the last 32 positions (the answers), named tokens.
  assert _tokens(browser) == [names[t] for t in first["inputs"][224:]]
  assert browser.js("document.querySelectorAll('#tokens td.answer')"
                    ".length") == 5
  assert browser.js("document.querySelectorAll('#head-svg text.query-token')"
                    ".length") == 32
  assert browser.js("document.querySelectorAll('canvas.thumb').length") == 4
  thumb = "canvas.thumb[data-layer='0'][data-head='0']"
  assert _grey(browser, thumb, 255, 0) == [228, 228, 228]  # Masked key.
  assert _grey(browser, thumb, 0, 0) != [228, 228, 228]
  # The slider moves the window; "end" and "answers" bring it back.
  browser.js("const s = document.getElementById('window-slider');"
             "s.value = '10'; s.dispatchEvent(new Event('input'))")
  assert _tokens(browser) == [names[t] for t in first["inputs"][10:42]]
  assert browser.js("document.getElementById('window-start').value") == "10"
  browser.js("const w = document.getElementById('window-size');"
             "w.value = '8'; w.dispatchEvent(new Event('change'))")
  assert len(_tokens(browser)) == 8
  browser.click("#window-end")
  assert _tokens(browser) == [names[t] for t in first["inputs"][248:]]
  browser.click("#window-answers")
  assert len(_tokens(browser)) == 32
  # Enlarged: the window's 32 queries against the keys they can see.
  browser.click(thumb)
  title = browser.js("document.getElementById('enlarged-title').textContent")
  assert "queries 224–255, keys 0–255 of 256" in title and "masked" in title
  shot = browser.screenshot()
  _is_not_blank(shot)
  with open(os.environ.get("CAUSAL_SCREENSHOT", os.devnull), "wb") as f:
    f.write(shot)
  # The next example keeps the page usable: its own window.
  browser.click("#next-example")
  assert len(_tokens(browser)) == 32
  # An encoder's short sequences: no window, every token.
  browser.events.clear()  # Else the last page's load event ends the wait.
  browser.open(page[0])
  assert browser.js("document.body.dataset.ready") == "1"
  assert browser.js(f"{controls}.classList.contains('hidden')") is True
