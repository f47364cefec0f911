"""Tests for benchmarks/ngram.py (the byte n-gram baseline of the character LM)."""

import collections

import numpy as np
import pytest

from benchmarks import ngram

TEXT = (b"def f(x):\n  return x + 1\n\n\ndef g(y):\n  return f(y) * 2\n\n"
        b"class A:\n  def h(self):\n    return g(3)\n") * 3


def _reference(train: bytes, order: int):
  """p(w | h) of interpolated modified Kneser-Ney, with dicts and loops:
  the formulas of the module docstring, written plainly."""
  raw = collections.Counter(train[i:i + order]
                            for i in range(len(train) - order + 1))
  levels = {order: raw}
  for n in range(1, order):
    grams = {train[i:i + n + 1] for i in range(len(train) - n)}
    levels[n] = collections.Counter(g[1:] for g in grams)

  def p(w: int, h: bytes, n: int = order) -> float:
    if n == 0:
      return 1 / 256
    lower = p(w, h, n - 1)  # Each level reads the last bytes of h.
    counts = levels[n]
    d = ngram.discounts(np.array(list(counts.values())))
    context = h[len(h) - (n - 1):] if n > 1 else b""
    if len(context) < n - 1:
      return lower
    seen = {g: c for g, c in counts.items() if g[:-1] == context}
    total = sum(seen.values())
    if not total:
      return lower
    gamma = sum(d[min(c, 3)] for c in seen.values())
    c = seen.get(context + bytes([w]), 0)
    return (max(c - d[min(c, 3)], 0) + gamma * lower) / total

  return p


def test_discounts():
  # n1..n4 = 4, 2, 1, 1: Y = 1/2, D1 = 1 - 2 Y 2/4, D2 = 2 - 3 Y 1/2,
  # D3+ = 3 - 4 Y 1/1.
  np.testing.assert_allclose(
      ngram.discounts(np.array([1, 1, 1, 1, 2, 2, 3, 4, 9])),
      [0, 0.5, 1.25, 1.0])
  # Too few counts of counts: clipped into [0.1, k - 0.1], 0.5 k undefined.
  np.testing.assert_allclose(ngram.discounts(np.array([1, 2])),
                             [0, 1 / 3, 1.9, 1.5])


def test_known_tiny_example():
  """"abab", order 2, by hand. Bigrams ab (2) and ba (1): D1 = 1/3, D2 =
  1.9 (clipped), so gamma(a) = 1.9. Unigram continuation counts a (1), b
  (1): D1 = 0.9 (clipped), gamma = 1.8, so p1(b) = (1 - 0.9 + 1.8 / 256) /
  2. Then p(b | a) = (2 - 1.9 + 1.9 p1(b)) / 2."""
  model = ngram.fit(b"abab", 2)
  p1_b = (1 - 0.9 + 1.8 / 256) / 2
  got = ngram.distribution(model, b"a")
  assert got[ord("b")] == pytest.approx((2 - 1.9 + 1.9 * p1_b) / 2,
                                        rel=1e-12)
  assert got[ord("z")] == pytest.approx(1.9 * (1.8 / 256 / 2) / 2, rel=1e-12)
  # An unseen context backs off to the unigram level entirely.
  assert ngram.distribution(model, b"q")[ord("b")] == pytest.approx(p1_b)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_sums_to_one_and_matches_reference(order):
  model = ngram.fit(TEXT, order)
  reference = _reference(TEXT, order)
  for context in (b"def f(", b"  retu", b"xyzzy!", b"\n\n\n", b"", b"d"):
    probs = ngram.distribution(model, context)
    assert probs.shape == (256,) and np.all(probs > 0)
    assert probs.sum() == pytest.approx(1.0, abs=1e-12)
    for w in b"ertf(\n\x01":
      assert probs[w] == pytest.approx(reference(w, context), rel=1e-10)


def test_fit_all_and_stream_scores():
  models = ngram.fit_all(TEXT, (2, 3))
  assert set(models) == {2, 3}
  # Lower levels shared; the top level raw counts.
  assert models[3].levels[0] is models[2].levels[0]
  assert ngram.sizes(models)[2] == len(set(zip(TEXT, TEXT[1:])))
  test = b"def h(x):\n  return x\n"
  for order, model in models.items():
    scores = ngram.log2_probs(model, test, chunk=5)  # several chunks
    by_hand = [np.log2(ngram.distribution(model, test[:i])[test[i]])
               for i in range(len(test))]
    np.testing.assert_allclose(scores, by_hand, rtol=1e-12)
    assert ngram.bits_per_char(model, test) == pytest.approx(-np.mean(by_hand))


def test_pylm_targets_and_bad_input():
  # 10 bytes, windows of 3: targets at positions 1..9.
  np.testing.assert_array_equal(ngram.pylm_targets(10, 3), np.arange(1, 10))
  np.testing.assert_array_equal(ngram.pylm_targets(9, 3), np.arange(1, 7))
  with pytest.raises(ValueError, match="empty"):
    ngram.fit(b"", 2)
  with pytest.raises(ValueError, match="orders"):
    ngram.fit_all(TEXT, (0, 2))
  with pytest.raises(ValueError, match="orders"):
    ngram.fit_all(TEXT, (9,))


def test_baseline_script_on_a_tiny_corpus(tiny_corpus):
  from benchmarks import ngram_baseline  # pylint: disable=import-outside-toplevel
  results = ngram_baseline.baseline((1, 2), 16, tiny_corpus)
  assert [row["order"] for row in results["rows"]] == [1, 2]
  for row in results["rows"]:
    assert 0 < row["test"] < 8 and 0 < row["validation"] < 8
  lines = ngram_baseline.table(results).splitlines()
  assert len(lines) == 4 and lines[2].startswith("| 1 |")
