"""Which dataset each row of a mixture comes from: exact proportions, by index, with no state.

The datasets take turns by nested splitting: of the first n rows, dataset 0 gets n - floor(n * (1 - w0)),
the rest split the remaining rows the same way among themselves. Each count grows by 0 or 1 per row and
stays within one row per dataset of its share, so any window of a run holds the weights' proportions to
within a row per dataset, and the dataset of row g (the one whose count grows between g and g + 1) and its
index there (its count before g) are computed for any g directly. That makes a mixture a random-access
dataset like a single one: a batch is read from its index, and a resumed run needs no more than the index.
"""

import numpy as np

_SCALE = 1 << 20  # weights as integers in units of 2**-20: exact integer arithmetic for up to 2**43 rows


class Mixture:
  def __init__(self, weights: list[float]):
    total = sum(weights)
    self.weights = [w / total for w in weights]
    units = [max(1, round(w * _SCALE)) for w in self.weights]
    self._units = np.asarray(units, np.int64)
    self._remaining = np.cumsum(self._units[::-1])[::-1]  # the sum of units from dataset k on

  def counts(self, n: np.ndarray) -> np.ndarray:
    """[len(n), datasets]: how many of the first n rows come from each dataset."""
    n = np.asarray(n, np.int64).copy()
    out = np.empty((len(n), len(self._units)), np.int64)
    for k, (units, remaining) in enumerate(zip(self._units, self._remaining)):
      rest = n * (remaining - units) // remaining
      out[:, k] = n - rest
      n = rest
    return out

  def select(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, index within it) of each global row index."""
    rows = np.asarray(rows, np.int64)
    before, after = self.counts(rows), self.counts(rows + 1)
    dataset = np.argmax(after - before, axis=1)
    return dataset, before[np.arange(len(rows)), dataset]
