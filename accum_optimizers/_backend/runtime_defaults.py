"""The answers of a backend that has nothing to give (see
`_backend/__init__.py`): a `*_runtime.py` module takes those it needs."""


def compiled_peak(model, batch):
    """`None`: no memory analysis of a step that has not run.

    Args:
        model: a compiled `keras.Model`.
        batch: the train step's data.
    """
    return None


def asserted_normalizer(weight, skips, message):
    """`None`: no assertion in compiled code, so `weigh_micro_batches`
    makes an invalid traced weight NaN instead.

    Args:
        weight: the micro-batch's traced loss normalizer.
        skips: whether a non-finite `weight` marks a micro-batch to skip.
        message: the assertion's message.
    """
    return None


def random_state():
    """The backend's own global random state beside Keras': `None`."""
    return None


def set_random_state(state):
    """Puts back `random_state()`'s state: there is none.

    Args:
        state: what `random_state()` returned.
    """


def quiet_python_logger():
    """Nothing: the backend has no Python logger of its own to quiet."""
