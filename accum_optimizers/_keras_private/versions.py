"""The supported Keras versions, and what differs between them."""

import os
import re

import keras

# Keras 3.9 lacks `keras.Variable(synchronization=...)`.
MINIMUM_KERAS = (3, 10)
SUPPORTED_KERAS = "Keras >= 3.10, < 4 (and keras-nightly 3.x)"

# Optimizers (and optimizer wrappers) that Keras added after 3.10, the
# oldest supported release, with the release that added each.
OPTIMIZERS_ADDED_IN = {"ScheduleFreeAdamW": "3.14.0"}


def keras_version():
    """The installed Keras' version string (`keras.version()`)."""
    version = getattr(keras, "version", None)
    return version() if callable(version) else str(keras.__version__)


def _release(version):
    """`"3.16.0.dev2026102704"` -> `(3, 16, 0)`."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        return ()
    return tuple(int(number) for number in match.groups() if number)


def check_keras_version():
    """Raises `ImportError` unless the Keras that `import keras` gives is a
    supported Keras 3, and `tf.keras` is not routed to Keras 2."""
    version = keras_version()
    release = _release(version)
    if release < MINIMUM_KERAS or release[:1] != (3,):
        raise ImportError(
            f"accum_optimizers supports {SUPPORTED_KERAS}; the installed "
            f"Keras is {version}. Install a supported one, e.g. "
            "`pip install -U 'keras>=3.10'`."
        )
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "")
    if legacy in ("true", "True", "1"):
        raise ImportError(
            f"TF_USE_LEGACY_KERAS={legacy} makes `tf.keras` Keras 2 "
            f"(tf_keras{_distribution_version('tf_keras')}), and "
            f"accum_optimizers supports {SUPPORTED_KERAS}, not Keras 2. The "
            f"installed Keras 3 is {version}: unset TF_USE_LEGACY_KERAS and "
            "build models with `keras` (not `tf.keras`)."
        )


def _distribution_version(name):
    from importlib import metadata

    try:
        return f" {metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return ", not installed"


def missing_optimizer_message(name):
    """Why `<name>Accumulate` is missing: `name`, a Keras optimizer, was
    added after the installed Keras."""
    return (
        f"`{name}Accumulate` needs `keras.optimizers.{name}`, which Keras "
        f"added in {OPTIMIZERS_ADDED_IN[name]}; the installed Keras is "
        f"{keras_version()}. Upgrade Keras (`pip install -U "
        f"'keras>={OPTIMIZERS_ADDED_IN[name]}'`) to use it."
    )
