"""Worker for test_multiprocess_jax.py: one of two JAX processes.

    KERAS_BACKEND=jax python multiprocess_jax_worker.py \
        127.0.0.1:PORT PROCESS_ID OUT_DIR

Joins the others with `keras.distribution.initialize` (JAX's gloo CPU
collectives), sets `DataParallel` over every process's devices with
`auto_shard_dataset=False`, and fits, feeding this process's own shard of
every global micro-batch of `GLOBAL_MICRO` samples (the rows
`[PROCESS_ID * SHARD, (PROCESS_ID + 1) * SHARD)` of each micro-batch;
Keras puts the processes' shards together in process order), three runs
of `AdamAccumulate(accum_iters=K)`:

- `plain`: `WINDOWS` windows, fitted in two calls; between them, after
  `MID_WINDOW_AT` micro-batches (mid-window), every process saves the
  model, process 0 to OUT_DIR/0-mid_window.keras, the others to scratch
  files;
- `skip`: `skip_nonfinite=True` on one micro-batch more, whose shard in
  process `POISONED_PROCESS` only holds a NaN (micro-batch `POISONED`);
- `weighted`: `weigh_micro_batches` with sample weights (some 0) and the
  `mean_with_sample_weight` reduction, so each micro-batch weighs the sum
  of its global sample weights.

Writes OUT_DIR/process<PROCESS_ID>.json: every run's final weights (float32
values, exactly) and counters. The test judges them against the parent
Keras optimizer on the big batch, trained in its own process. Exits with
`NO_COLLECTIVES_EXIT` when this jaxlib has no gloo CPU collectives.
"""

import json
import sys
from pathlib import Path

import jax

PROCESSES = 2
DEVICES_PER_PROCESS = 2  # the test sets XLA_FLAGS to match
K = 3
GLOBAL_MICRO = 4
SHARD = GLOBAL_MICRO // PROCESSES
WINDOWS = 3
SEED = 11
LEARNING_RATE = 0.01
MID_WINDOW_AT = K + 1  # micro-batches fitted before process 0 saves
POISONED = 4  # the skipped micro-batch (second window's second)
POISONED_PROCESS = 1
NO_COLLECTIVES_EXIT = 77


def _has_gloo_factory():
    """Whether jaxlib has the function JAX makes gloo collectives with
    (`jax._src.xla_bridge` calls it; its module moved between releases)."""
    from jax._src.lib import xla_client

    modules = [getattr(xla_client, "_xla", None)]
    try:
        from jax._src.lib import _jax

        modules.append(_jax)
    except ImportError:
        pass
    return any(hasattr(m, "make_gloo_tcp_collectives") for m in modules)


def enable_cpu_collectives():
    """Selects gloo for JAX's CPU collectives; exits with
    `NO_COLLECTIVES_EXIT`, saying why, where this jax or jaxlib has none
    (no such option, or no gloo in jaxlib)."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if not _has_gloo_factory():
            raise RuntimeError("jaxlib has no make_gloo_tcp_collectives")
    except (AttributeError, RuntimeError, ValueError) as error:
        print(
            f"no gloo CPU collectives in jax {jax.__version__}: {error}",
            file=sys.stderr,
        )
        sys.exit(NO_COLLECTIVES_EXIT)


def micro_batch_count(run):
    """How many global micro-batches `run` fits."""
    return WINDOWS * K + (1 if run == "skip" else 0)


def global_data(run):
    """`(x, y, sample_weight)` of every global micro-batch of `run`, in
    order; `sample_weight` is `None` but for `weighted`. The same in every
    process and in the test."""
    import numpy as np
    from helpers import regression_data
    from helpers import sample_weights

    samples = micro_batch_count(run) * GLOBAL_MICRO
    x, y = regression_data(SEED, samples)
    if run == "skip":
        x[POISONED * GLOBAL_MICRO + POISONED_PROCESS * SHARD, 0] = np.nan
    weights = sample_weights(SEED, samples) if run == "weighted" else None
    return x, y, weights


def process_shard(array, process_id):
    """The rows of `array` this process feeds: its shard of each global
    micro-batch, micro-batch after micro-batch."""
    if array is None:
        return None
    batches = array.reshape((-1, GLOBAL_MICRO) + array.shape[1:])
    shard = batches[:, process_id * SHARD : (process_id + 1) * SHARD]
    return shard.reshape((-1,) + array.shape[1:])


def loss_of(run):
    import keras

    if run == "weighted":
        return keras.losses.MeanSquaredError(
            reduction="mean_with_sample_weight"
        )
    return keras.losses.MeanSquaredError()


def fit_run(run, process_id, out_dir):
    """Fits `run` under the distribution already set; returns its record."""
    from helpers import small_model

    from accum_optimizers import AdamAccumulate
    from accum_optimizers import weigh_micro_batches

    x, y, weights = (process_shard(a, process_id) for a in global_data(run))
    model = small_model(SEED)
    # Made in the distribution's scope, like the model: its counters are
    # variables, which the train step wants on every device.
    optimizer = AdamAccumulate(
        LEARNING_RATE, accum_iters=K, skip_nonfinite=run == "skip"
    )
    model.compile(optimizer=optimizer, loss=loss_of(run))
    if run == "weighted":
        weigh_micro_batches(model)
    record = {}
    split = MID_WINDOW_AT * SHARD if run == "plain" else len(x)
    parts = [slice(0, split), slice(split, len(x))]
    for number, part in enumerate(parts):
        if part.start == part.stop:
            continue
        model.fit(
            x[part],
            y[part],
            sample_weight=None if weights is None else weights[part],
            batch_size=SHARD,  # per process: the global micro-batch's shard
            shuffle=False,
            verbose=0,
        )
        if run == "plain" and number == 0:
            record["saved_micro_steps"] = int(optimizer.micro_steps)
            # Every process saves: Keras' saving makes a throwaway optimizer
            # whose variable goes onto every process's devices, a
            # collective that a lone process 0 waits on (Keras 3.15). Only
            # process 0's file is kept.
            name = "mid_window.keras" if process_id == 0 else "scratch.keras"
            model.save(Path(out_dir) / f"{process_id}-{name}")
    record.update(
        weights=[w.tolist() for w in model.get_weights()],
        iterations=int(optimizer.iterations),
        micro_steps=int(optimizer.micro_steps),
        skipped_micro_batches=int(optimizer.skipped_micro_batches),
        device_count=len(
            model.trainable_variables[0].value.sharding.device_set
        ),
    )
    return record


def main(coordinator, process_id, out_dir):
    process_id = int(process_id)
    enable_cpu_collectives()
    import keras

    keras.distribution.initialize(
        job_addresses=coordinator,
        num_processes=PROCESSES,
        process_id=process_id,
    )
    devices = jax.devices()  # every process's, in process order
    expected = PROCESSES * DEVICES_PER_PROCESS
    if len(devices) != expected or jax.process_index() != process_id:
        raise SystemExit(
            f"expected {expected} devices over {PROCESSES} processes, "
            f"found {devices} in process {jax.process_index()}"
        )
    distribution = keras.distribution.DataParallel(
        devices=devices, auto_shard_dataset=False
    )
    with distribution.scope():
        records = {
            run: fit_run(run, process_id, out_dir)
            for run in ("plain", "skip", "weighted")
        }
    out = Path(out_dir) / f"process{process_id}.json"
    out.write_text(json.dumps(records))


if __name__ == "__main__":
    main(*sys.argv[1:4])
