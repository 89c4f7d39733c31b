"""Blended data: several datasets drawn in the proportions of their weights (Megatron's BlendedDataset).

    --data-path 0.7 PREFIX_A 0.3 PREFIX_B        [data] data_path = [0.7, "PREFIX_A", 0.3, "PREFIX_B"]

Weights are normalized to sum to 1. The blend is a precomputed index saying, for each
draw k, which component it comes from and which of that component's draws it is.
Component i's n-th draw is due at blend position (n + 0.5) / w_i; the blend takes
draws in order of due position, ties to the lower i:

    w = (0.7, 0.3)   due A: 0.71 2.14 3.57 5.00 ...   due B: 1.67 5.00 8.33 ...
    draws             A  B  A  A  A  B  A  ...

so after k draws component i has had w_i * k of them, give or take one or two. The
index depends on the weights alone, so draw k is a pure function of k: a resumed run
and every layout (each dp rank cuts its share of a batch from the same draws) see the
same samples as an uninterrupted single-device run. Each component draws from its own
seeded order (data.GPTDataset), so a component smaller than its share starts new
epochs in a fresh order; the seed is where the blend's randomness comes from.
"""

import math
import shlex

import numpy as np

from gcompile.indexed_dataset import DataError


def parse_blend(data_path: str) -> list[tuple[float, str]]:
    """'PREFIX' -> [(1, PREFIX)]; '0.7 A 0.3 B' (shell-quoted words) -> [(0.7, A), (0.3, B)]."""
    words = shlex.split(data_path)
    form = "give one PREFIX, or weighted prefixes as 'W1 PREFIX1 W2 PREFIX2 ...' (Megatron's form)"
    if len(words) == 1:
        return [(1.0, words[0])]
    if len(words) == 0 or len(words) % 2:
        raise DataError(f"--data-path {data_path!r}: {len(words)} words; {form}")
    blend = []
    for weight, prefix in zip(words[::2], words[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise DataError(f"--data-path {data_path!r}: {weight!r} is not a weight; {form}") from None
        if not (math.isfinite(w) and w > 0):
            raise DataError(f"--data-path {data_path!r}: weight {weight} of {prefix} must be a positive number")
        blend.append((w, prefix))
    if not math.isfinite(sum(w for w, _ in blend)):  # each finite, their sum not: proportions of infinity
        raise DataError(f"--data-path {data_path!r}: the weights sum to more than a float holds; give smaller ones "
                        f"(only their proportions count)")
    return blend


def blend_index(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(component, draw within the component) of blend draws 0 .. size - 1; weights sum to 1.

    The first `size` due positions overall are all at most size + len(weights) / 2, so
    generating each component's draws up to position size + len(weights) covers them;
    the result for draw k is the same whatever `size` is.
    """
    dues, components, draws = [], [], []
    for i, w in enumerate(weights):
        n = np.arange(int(w * (size + len(weights))) + 2)
        dues.append((n + 0.5) / w)
        components.append(np.full(len(n), i))
        draws.append(n)
    dues, components, draws = map(np.concatenate, (dues, components, draws))
    first = np.lexsort((components, dues))[:size]  # by due position, then component
    return components[first], draws[first]


class BlendedDataset:
    """Batches from several datasets of the same seq_length, mixed by `blend_index`."""

    def __init__(self, datasets: list, weights: list[float]):
        self.datasets = datasets
        self.weights = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.seq_length = datasets[0].seq_length
        self._components, self._draws = np.empty(0, np.int64), np.empty(0, np.int64)

    def index(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """`blend_index` of the first `size` draws, grown by doubling and kept."""
        if len(self._components) < size:
            self._components, self._draws = blend_index(self.weights, max(size, 2 * len(self._components), 4096))
        return self._components[:size], self._draws[:size]

    def __len__(self) -> int:
        """Distinct samples across the components."""
        return sum(map(len, self.datasets))

    def batch(self, consumed_samples: int, batch_size: int) -> "torch.Tensor":
        """Draws consumed_samples .. consumed_samples + batch_size - 1 -> (B, L + 1) int64."""
        components, draws = (a[consumed_samples:] for a in self.index(consumed_samples + batch_size))
        import torch  # here, not at the top: the run config (and --help) reads data.py without torch
        out = torch.empty(batch_size, self.seq_length + 1, dtype=torch.int64)
        for i in np.unique(components):
            rows = components == i  # a component's draws in a run of the blend are consecutive
            out[torch.from_numpy(rows)] = self.datasets[i].batch(int(draws[rows][0]), int(rows.sum()))
        return out
