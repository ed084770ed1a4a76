"""Values as tuners hand them over (numpy scalars) configure the optimizers
and serialize as plain Python numbers."""

import json

import keras
import numpy as np
import pytest

from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate


@pytest.mark.parametrize("integer", [np.int64, np.int32, np.uint8])
@pytest.mark.parametrize("cls", [AdamAccumulate, SGDAccumulate])
def test_numpy_accum_iters_serializes_as_a_plain_int(cls, integer):
    optimizer = cls(learning_rate=np.float64(0.003), accum_iters=integer(4))
    config = optimizer.get_config()
    assert type(config["accum_iters"]) is int and config["accum_iters"] == 4
    text = json.dumps(keras.optimizers.serialize(optimizer))
    restored = keras.optimizers.deserialize(json.loads(text))
    assert type(restored) is cls
    assert restored.get_config() == config
