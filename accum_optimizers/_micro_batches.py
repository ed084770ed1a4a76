"""The samples side of `fit_to_memory`: arrays checked, and an epoch's
samples cut into weighted windows of micro-batches, in an order fixed per
epoch so that a micro-batch size changed mid-epoch resumes where it was."""

import keras
import numpy as np
from keras import ops


def arrays(x, y, sample_weight):
    """`(x, y, sample_weight)` with numpy leaves, all as long."""
    structure = (x, y, sample_weight)
    leaves = [leaf for leaf in keras.tree.flatten(x) if leaf is not None]
    for name, value in zip(("x", "y", "sample_weight"), structure):
        for leaf in keras.tree.flatten(value):
            if leaf is None:
                continue
            if not (isinstance(leaf, np.ndarray) or _is_tensor(leaf)):
                raise TypeError(
                    "fit_to_memory takes arrays (numpy arrays or backend "
                    "tensors, or lists, tuples or dicts of them): recovering "
                    "from an out-of-memory error re-cuts the epoch's "
                    "samples. Datasets, generators and `PyDataset`s are "
                    f"not supported. Received: {name} of type "
                    f"{type(leaf).__name__}"
                )
    if not leaves:
        raise ValueError("fit_to_memory: `x` holds no array.")
    return keras.tree.map_structure(
        lambda leaf: (
            None if leaf is None else np.asarray(ops.convert_to_numpy(leaf))
        ),
        structure,
    )


def _is_tensor(value):
    return ops.is_tensor(value) or type(value).__module__.startswith(
        ("tensorflow", "jax", "torch")
    )


def sample_count(data):
    """The number of samples every array of `data` holds (one, > 0)."""
    counts = {
        int(np.shape(leaf)[0])
        for leaf in keras.tree.flatten(data)
        if leaf is not None
    }
    if len(counts) != 1:
        raise ValueError(
            "fit_to_memory: `x`, `y` and `sample_weight` must hold the same "
            f"number of samples. Received: sample counts {sorted(counts)}"
        )
    (count,) = counts
    if count == 0:
        raise ValueError("fit_to_memory: `x` holds no sample.")
    return count


def head(data, size):
    """`data`'s first `size` samples."""
    return _map(lambda leaf: leaf[:size], data)


def _map(function, data):
    """`function` on every array of `data`, `None`s kept."""
    return keras.tree.map_structure(
        lambda leaf: None if leaf is None else function(leaf), data
    )


class EpochOrder:
    """The samples' order in each epoch: drawn from `seed` and the epoch
    number, so that a resumed epoch sees the order it started with."""

    def __init__(self, count, shuffle, seed):
        self.count = count
        self.shuffle = shuffle
        self.seed = seed

    def __call__(self, epoch):
        if not self.shuffle:
            return np.arange(self.count)
        return np.random.default_rng([self.seed, epoch]).permutation(self.count)


class MicroBatches(keras.utils.PyDataset):
    """An epoch's micro-batches from sample `start` of its order: each
    window of `target` samples (the last shorter) cut into micro-batches of
    `size` (a window's last one shorter)."""

    def __init__(self, data, order, target, size, start):
        super().__init__()
        self.data = data
        self.order = order
        self.epoch = 0
        self.bounds = []
        count = order.count
        low = start
        while low < count:
            window_end = min(count, (low // target + 1) * target)
            high = min(low + size, window_end)
            self.bounds.append((low, high))
            low = high

    def __len__(self):
        return len(self.bounds)

    def __getitem__(self, index):
        low, high = self.bounds[index]
        samples = self.order(self.epoch)[low:high]
        x, y, sample_weight = _map(lambda leaf: leaf[samples], self.data)
        if sample_weight is None:
            return (x,) if y is None else (x, y)
        return x, y, sample_weight
