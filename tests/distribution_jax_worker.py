"""Worker for test_distribution_jax.py: trains under a JAX distribution.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 KERAS_BACKEND=jax \
        python distribution_jax_worker.py RESULT.json

Needs two JAX devices, which only exist if `XLA_FLAGS` is set before JAX
starts, hence a process of its own. For every case in `CASES` it

1. trains the parent Keras optimizer with no distribution set (one device)
   on batches of `ACCUM_ITERS * MICRO_BATCH` samples: the oracle;
2. trains our optimizer with `accum_iters=ACCUM_ITERS` from the same
   initial weights, in the same data order, under the case's distribution
   (set by `distribution.scope()`, which restores "none" on exit), on global
   micro-batches of `MICRO_BATCH` samples that the distribution splits over
   the devices;

and writes both runs' final weights and optimizer variables, our
optimizer's counters, and the sharding and Keras layout of every model
variable next to those of each of its optimizer variables (our accumulator
and the parent's own slots), after `build` and after `fit`, to RESULT.json.
test_distribution_jax.py judges them.
"""

import json
import sys
from typing import NamedTuple

import keras
from helpers import PARENTS
from helpers import regression_data
from helpers import small_model
from helpers import window_state

from accum_optimizers import AdamAccumulate
from accum_optimizers import RMSpropAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers import schedules
from accum_optimizers import weigh_micro_batches

DEVICE_COUNT = 2
ACCUM_ITERS = 3
MICRO_BATCH = 4  # global; 2 samples per device
WINDOWS = 2
SEED = 7

_schedules = keras.optimizers.schedules


class Case(NamedTuple):
    """One optimizer configuration, trained once per distribution."""

    optimizer_class: type
    shared_kwargs: dict  # for our optimizer and its parent alike
    distribution: str  # "data" (DataParallel) or "model" (ModelParallel)
    compare_weights: bool = True  # ours must equal the parent's
    our_kwargs: dict = {}  # for our optimizer only
    parent_kwargs: dict = {}  # for the parent only
    weighed: bool = False  # `weigh_micro_batches(model)`: samples count


CASES = {
    "adam": Case(AdamAccumulate, {"learning_rate": 0.01}, "data"),
    "sgd_nesterov_momentum": Case(
        SGDAccumulate,
        {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
        "data",
    ),
    "rmsprop_centered_momentum": Case(
        RMSpropAccumulate,
        {"learning_rate": 0.01, "momentum": 0.5, "centered": True},
        "data",
    ),
    "adam_schedule_clip_decay": Case(
        AdamAccumulate,
        {
            "learning_rate": _schedules.ExponentialDecay(
                0.01, decay_steps=1, decay_rate=0.5
            ),
            "global_clipnorm": 0.5,
            "weight_decay": 0.01,
            "amsgrad": True,
        },
        "data",
    ),
    # Kernels sharded over the "model" axis: a layout that is not just
    # "replicated", so the layout check can tell layouts apart.
    "adam_model_parallel": Case(
        AdamAccumulate, {"learning_rate": 0.01}, "model"
    ),
    # An accumulator whose dtype differs from its variable's may be created
    # on a separate path; bfloat16 sums drift, so only its layout is judged.
    "sgd_bfloat16_accumulators_model_parallel": Case(
        SGDAccumulate,
        {"learning_rate": 0.1, "momentum": 0.9},
        "model",
        compare_weights=False,
        our_kwargs={"accumulator_dtype": "bfloat16"},
    ),
    # The noise scale's scalars, and AdaScale's learning rate from them,
    # under a distribution: programs see global arrays, so it must measure
    # and scale as one device does (its weights differ from the parent's:
    # the gain is not 1).
    "sgd_adascale_noise_scale": Case(
        SGDAccumulate,
        {"momentum": 0.9},
        "data",
        compare_weights=False,
        our_kwargs={
            "learning_rate": schedules.adascale(0.1, base_batch_size=1),
            "measure_noise_scale": True,
            "noise_scale_momentum": 0.5,
        },
    ),
}


class _RuleOracle(_schedules.LearningRateSchedule):
    """The parent's learning rate that a scaling rule's run follows when
    each window is `scale` base batches: at the parent's update `n`, `tau
    = scale * n` and the rate `factor(tau) * base(tau)`."""

    def __init__(self, base, scale, factor):
        self.base, self.scale, self.factor = base, scale, factor

    def __call__(self, step):
        tau = keras.ops.cast(step, "float32") * self.scale
        return self.factor(tau) * self.base(tau)


def _rule_base():
    return _schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.8)


# The scaling rules' cases: under DataParallel programs see global arrays,
# so a window of ACCUM_ITERS global micro-batches of MICRO_BATCH samples
# weighs ACCUM_ITERS unweighted, ACCUM_ITERS * MICRO_BATCH samples weighted.
RULE_WARMUP = 4.0
RULE_BASE_SAMPLES = 8.0
RULE_SCALES = {  # the S of every window of each case
    "adam_linear_scaling": ACCUM_ITERS / 1.0,
    "sgd_momentum_sqrt_scaling_weighted": ACCUM_ITERS
    * MICRO_BATCH
    / RULE_BASE_SAMPLES,
}


def _linear_factor(scale):
    def factor(tau):
        progress = keras.ops.minimum(tau / RULE_WARMUP, 1.0)
        return keras.ops.minimum(scale, 1.0 + (scale - 1.0) * progress)

    return factor


CASES["adam_linear_scaling"] = Case(
    AdamAccumulate,
    {},
    "data",
    our_kwargs={
        "learning_rate": schedules.linear_scaling(
            _rule_base(), base_batch_size=1, warmup_steps=RULE_WARMUP
        )
    },
    parent_kwargs={
        "learning_rate": _RuleOracle(
            _rule_base(),
            RULE_SCALES["adam_linear_scaling"],
            _linear_factor(RULE_SCALES["adam_linear_scaling"]),
        )
    },
)
_SQRT_SCALE = RULE_SCALES["sgd_momentum_sqrt_scaling_weighted"]
CASES["sgd_momentum_sqrt_scaling_weighted"] = Case(
    SGDAccumulate,
    {"momentum": 0.9},
    "data",
    our_kwargs={
        "learning_rate": schedules.sqrt_scaling(
            _rule_base(), base_batch_size=RULE_BASE_SAMPLES
        )
    },
    parent_kwargs={
        "learning_rate": _RuleOracle(
            _rule_base(), _SQRT_SCALE, lambda tau: _SQRT_SCALE**0.5
        )
    },
    weighed=True,
)

# What the noise scale's case records, beside the same run on one device.
NOISE_READOUTS = (
    "noise_scale",
    "window_noise_trace",
    "window_gradient_sq_norm",
    "adascale_gain",
    "scale_invariant_step",
)

# Where the parent Keras optimizers keep their per-variable slots.
_PARENT_SLOT_ATTRIBUTES = (
    "_momentums",
    "_velocities",
    "_velocity_hats",
    "momentums",
    "_average_gradients",
)


def _distribution(kind, devices):
    if kind == "data":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    # Keys are full-matched: this one matches the model's kernels
    # ("sequential/dense/kernel") but none of the optimizer variables named
    # after them ("adam/sequential_dense_kernel_momentum"), which therefore
    # get a sharded layout only if given their variable's explicitly.
    layout_map[".*/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def _placement(variable):
    """The JAX sharding and Keras layout of `variable`, comparably."""
    sharding = variable.value.sharding
    layout = variable._layout
    return {
        "sharding": str(sharding),
        "device_count": len(sharding.device_set),
        "layout_axes": None if layout is None else list(layout.axes),
        "layout_mesh": None
        if layout is None
        else [
            list(layout.device_mesh.shape),
            list(layout.device_mesh.axis_names),
        ],
    }


def _placements(model, optimizer):
    """Each model variable's placement beside those of its slots.

    Slots are our `accumulator` and the parent's own per-variable slots
    (e.g. Adam's `_momentums`), whose placement Keras chose: the baseline.
    Scalars pair `iterations` (Keras') with our counters.
    """
    slot_lists = {"accumulator": window_state(optimizer)["sums"]}
    for attribute in _PARENT_SLOT_ATTRIBUTES:
        slots = getattr(optimizer, attribute, None)
        if slots:
            slot_lists[attribute] = slots
    per_variable = []
    for index, variable in enumerate(model.trainable_variables):
        reference = variable.value.sharding
        per_variable.append(
            {
                "path": variable.path,
                "variable": _placement(variable),
                "slots": {
                    kind: dict(
                        _placement(slots[index]),
                        equivalent=bool(
                            slots[index].value.sharding.is_equivalent_to(
                                reference, len(variable.shape)
                            )
                        ),
                    )
                    for kind, slots in slot_lists.items()
                },
            }
        )
    scalars = {
        "iterations": _placement(optimizer._iterations),
        "micro_steps": _placement(window_state(optimizer)["micro_steps"]),
        "micro_batches": _placement(window_state(optimizer)["micro_batches"]),
    }
    return {"per_variable": per_variable, "scalars": scalars}


def _values(variables):
    """`[path, value]` pairs: paths differ between runs, order does not."""
    return [
        [variable.path, keras.ops.convert_to_numpy(variable.value).tolist()]
        for variable in variables
    ]


def _run_case(name, devices, x, y):
    case = CASES[name]

    # The oracle: the parent optimizer on one device, k times larger batch.
    parent_model = small_model(SEED)
    initial_weights = parent_model.get_weights()
    parent = PARENTS[case.optimizer_class](
        **case.shared_kwargs, **case.parent_kwargs
    )
    parent_model.compile(optimizer=parent, loss="mse")
    parent_model.fit(
        x,
        y,
        batch_size=ACCUM_ITERS * MICRO_BATCH,
        shuffle=False,
        verbose=0,
    )
    parent_device_count = len(
        parent_model.trainable_variables[0].value.sharding.device_set
    )

    distribution = _distribution(case.distribution, devices)
    with distribution.scope():
        our_model = small_model(SEED)
        our_model.set_weights(initial_weights)
        ours = case.optimizer_class(
            accum_iters=ACCUM_ITERS, **case.shared_kwargs, **case.our_kwargs
        )
        our_model.compile(optimizer=ours, loss="mse")
        if case.weighed:
            weigh_micro_batches(our_model)
        ours.build(our_model.trainable_variables)
        after_build = _placements(our_model, ours)
        our_model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
        after_fit = _placements(our_model, ours)
        data_layout_axes = list(
            distribution.get_data_layout((MICRO_BATCH, x.shape[1])).axes
        )
    assert keras.distribution.distribution() is None
    rule = {}
    if name in RULE_SCALES:
        rule = {
            "window_scale": float(ours.window_scale),
            "scale_invariant_step": float(ours.scale_invariant_step),
        }
    noise = {}
    if case.our_kwargs.get("measure_noise_scale"):
        alone_model = small_model(SEED)
        alone_model.set_weights(initial_weights)
        alone = case.optimizer_class(
            accum_iters=ACCUM_ITERS, **case.shared_kwargs, **case.our_kwargs
        )
        alone_model.compile(optimizer=alone, loss="mse")
        alone_model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
        for name in NOISE_READOUTS:
            noise[name] = float(getattr(ours, name))
            noise[f"one_device_{name}"] = float(getattr(alone, name))
        noise["one_device_weights"] = [
            w.tolist() for w in alone_model.get_weights()
        ]
    parent_state = parent.variables
    return {
        "rule": rule,
        "noise": noise,
        "parent_device_count": parent_device_count,
        "parent_iterations": int(parent.iterations),
        "parent_weights": [w.tolist() for w in parent_model.get_weights()],
        "our_weights": [w.tolist() for w in our_model.get_weights()],
        # Ours starts with the parent's own variables, in the same order.
        "parent_state": _values(parent_state),
        "our_state": _values(ours.variables[: len(parent_state)]),
        "iterations": int(ours.iterations),
        "micro_steps": int(ours.micro_steps),
        "micro_batches_seen": int(ours.micro_batches_seen),
        "data_layout_axes": data_layout_axes,
        "after_build": after_build,
        "after_fit": after_fit,
    }


def main(result_path):
    import jax

    devices = jax.devices()
    if len(devices) != DEVICE_COUNT:
        raise SystemExit(
            f"expected {DEVICE_COUNT} JAX devices, found {devices}; set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=2"
        )
    x, y = regression_data(SEED, WINDOWS * ACCUM_ITERS * MICRO_BATCH)
    results = {name: _run_case(name, devices, x, y) for name in CASES}
    with open(result_path, "w") as result_file:
        json.dump(results, result_file)


if __name__ == "__main__":
    main(sys.argv[1])
