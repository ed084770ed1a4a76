"""Scalar writers for TensorBoard event files, on any Keras backend.

`tensorboard`'s own `Writer` needs only numpy, so JAX and torch processes do
not import TensorFlow for it; TensorFlow's `tf.summary` (what Keras'
`TensorBoard` callback uses) is the fallback where only TensorFlow is
installed. Both write the same scalar summaries.
"""

import importlib.util
from typing import Union

INSTALL_HINT = (
    "Writing TensorBoard event files needs the `tensorboard` package (or "
    "TensorFlow). Install it with `pip install tensorboard`."
)


def available() -> bool:
    """Whether `tensorboard` or TensorFlow is installed."""
    return any(
        importlib.util.find_spec(name) is not None
        for name in ("tensorboard", "tensorflow")
    )


class _TensorBoardWriter:
    def __init__(self, logdir: str) -> None:
        from tensorboard.summary import Writer

        self._writer = Writer(logdir)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self._writer.close()


class _TFWriter:
    def __init__(self, logdir: str) -> None:
        import tensorflow as tf

        self._summary = tf.summary
        self._writer = tf.summary.create_file_writer(logdir)

    def scalar(self, tag: str, value: float, step: int) -> None:
        with self._writer.as_default():
            self._summary.scalar(tag, value, step=step)

    def close(self) -> None:
        self._writer.close()


def scalar_writer(logdir: str) -> Union[_TensorBoardWriter, _TFWriter]:
    """A writer of scalar summaries to an event file in `logdir`.

    It has `scalar(tag, value, step)` and `close()`.
    """
    try:
        return _TensorBoardWriter(logdir)
    except ImportError:
        pass
    try:
        return _TFWriter(logdir)
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
