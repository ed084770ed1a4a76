"""One fit of ours against the parent on the big batch, and the device.

    KERAS_BACKEND=jax python -m benchmarks.exactness [--windows 24] [--smoke]

From the same initial weights and data order, trains the benchmark MLP
(`workloads.build("mlp")`) with `AdamAccumulate(accum_iters=4)` at the
micro-batch `b` and with Keras' `Adam` at `4b`, for `--windows` updates,
and prints one JSON line: the largest absolute weight difference, the
largest weight (to read it relatively), and what ran it (backend and
Keras versions, the device, whether it is a GPU). Float32 matrix products
run at full float32 precision (no TF32): the contract is float32
round-off, which TF32's 10-bit mantissa would hide.
"""

import argparse
import json
import os

K = 4
SMOKE_WINDOWS = 2


def full_float32_precision(backend):
    """Turns off TF32 matrix products (JAX's and TensorFlow's default on
    recent NVIDIA GPUs) before the backend computes anything."""
    if backend == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)
    elif backend == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def device(backend):
    """`(description, is a GPU)` of the device the backend computes on."""
    if backend == "jax":
        import jax

        first = jax.devices()[0]
        return f"{first.platform}: {first.device_kind}", first.platform == "gpu"
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return "cpu", False
        details = tf.config.experimental.get_device_details(gpus[0])
        return f"gpu: {details.get('device_name', gpus[0].name)}", True
    import torch

    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}", True
    return "cpu", False


def backend_version(backend):
    from importlib import metadata

    for distribution in {
        "jax": ("jaxlib", "jax"),
        "tensorflow": ("tensorflow", "tensorflow-cpu"),
        "torch": ("torch",),
    }[backend]:
        try:
            return f"{distribution} {metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def largest_difference(windows):
    """Trains both runs for `windows` updates; returns `(largest absolute
    weight difference, largest absolute weight of the parent's)`."""
    import keras
    import numpy as np

    from accum_optimizers import AdamAccumulate
    from benchmarks import workloads

    micro_batch = workloads.WORKLOADS["mlp"][0]
    x, y = workloads.data("mlp", windows * K * micro_batch)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    final = {}
    for name, optimizer, batch in (
        ("ours", AdamAccumulate(accum_iters=K), micro_batch),
        ("parent", keras.optimizers.Adam(), K * micro_batch),
    ):
        model = workloads.build("mlp", seed=0)  # same initial weights
        model.compile(optimizer=optimizer, loss=loss)
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        assert int(optimizer.iterations) == windows, (name, windows)
        final[name] = model.get_weights()
    difference = max(
        float(np.abs(a - b).max())
        for a, b in zip(final["ours"], final["parent"])
    )
    return difference, max(float(np.abs(w).max()) for w in final["parent"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=24)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.windows < 1:
        parser.error(f"--windows must be at least 1, got {args.windows}")
    windows = SMOKE_WINDOWS if args.smoke else args.windows
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    full_float32_precision(backend)
    import keras

    description, is_gpu = device(backend)
    difference, largest_weight = largest_difference(windows)
    print(
        json.dumps(
            {
                "backend": backend,
                "keras": keras.__version__,
                "backend_version": backend_version(backend),
                "device": description,
                "gpu": is_gpu,
                "windows": windows,
                "accum_iters": K,
                "max_abs_difference": difference,
                "largest_weight": largest_weight,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
