"""The `fit` cases the weighted-window workers share
(weighted_mirrored_worker.py, weighted_dataparallel_worker.py): micro-batches
that differ (sample weights, masked variable-length sequences), with their
data, model, loss and normalizers, fitted in the data's order, ours weighed
with `weigh_micro_batches`, the oracle (the parent Keras optimizer on one
device) on the big batches.
"""

import keras
import numpy as np
from helpers import fit_in_order
from helpers import regression_data
from helpers import sample_weights
from helpers import sequence_data
from helpers import sequence_model
from helpers import small_model


class FitCase:
    """A model fitted on `samples` samples whose micro-batches differ."""

    def __init__(self, kind, reduction, samples):
        self.kind = kind  # "dense" (sample weights) or "sequences" (masks)
        self.reduction = reduction
        self.samples = samples

    def data(self):
        """`x, y, sample_weight`."""
        if self.kind == "dense":
            x, y = regression_data(0, self.samples)
            return x, y, sample_weights(0, self.samples)
        return (*sequence_data(1, self.samples), None)

    def model(self):
        if self.kind == "dense":
            return small_model(0)
        return sequence_model(0)

    def loss(self):
        if self.kind == "dense":
            return keras.losses.MeanSquaredError(reduction=self.reduction)
        return keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=self.reduction
        )

    def normalizer(self, x, sample_weight, indices):
        """What Keras divides the loss of the samples `indices` by."""
        if self.kind == "sequences":
            return int(np.count_nonzero(x[indices]))
        if self.reduction == "mean_with_sample_weight":
            return float(sample_weight[indices].sum())
        return len(x[indices])

    def fit(self, model, batch_size, weighed=False):
        """Fits the compiled `model` on the case's data at `batch_size`;
        `weighed`: ours, weighed, a partial last window flushed."""
        x, y, sample_weight = self.data()
        fit_in_order(
            model,
            x,
            y,
            sample_weight=sample_weight,
            batch_size=batch_size,
            weigh=weighed,
            flush=weighed,
        )
