"""TensorFlow without XLA: the window's close compiled as one XLA
computation, where the optimizer's `jit_compile` asks for it."""

import math
import platform
import warnings

import tensorflow as tf


def compiled_close(close, window, jit_compile):
    """`close` compiled where `jit_compile` (`True`, `False` or `"auto"`)
    asks for it and XLA compiles it; else `close`."""
    if not _compiles(jit_compile, window):
        return close
    return _compiled(close, window, asked=jit_compile is True)


# `jit_compile="auto"` compiles a close from this many parameters: below
# it, on a CPU, launching the XLA computation costs more than its fusion
# saves.
AUTO_COMPILED_PARAMETERS = 2**17
# What a compiled close costs and saves on a CPU (`benchmarks.compile_cost`,
# `benchmarks.window_steps --compiled-close`): XLA's compile, on the first
# trace, grows with the number of variables, not their size;
COMPILE_SECONDS_PER_VARIABLE = 0.03
# each window then saves the temporaries' memory traffic, per parameter.
SAVED_SECONDS_PER_PARAMETER = 2e-9
# "auto" compiles a close that repays its compile within this many windows
# (a short `fit` need not pay for what only a long run gets back),
AUTO_PAYBACK_WINDOWS = 500
# that is, one of at least this many parameters per variable (30,000).
AUTO_PARAMETERS_PER_VARIABLE = round(
    COMPILE_SECONDS_PER_VARIABLE
    / AUTO_PAYBACK_WINDOWS
    / SAVED_SECONDS_PER_PARAMETER
)


def _compiles(jit_compile, window):
    """Whether `window`'s close is to be compiled: the optimizer's
    `jit_compile`, where `"auto"` is `auto_compiles`."""
    if jit_compile != "auto":
        return jit_compile
    return auto_compiles([total.shape for total in window.sums])


def auto_compiles(shapes):
    """Whether `jit_compile="auto"` compiles a close whose sums have these
    `shapes`: from `AUTO_COMPILED_PARAMETERS` parameters, and
    `AUTO_PARAMETERS_PER_VARIABLE` per variable on average."""
    parameters = sum(math.prod(shape) for shape in shapes)
    return (
        parameters >= AUTO_COMPILED_PARAMETERS
        and parameters >= AUTO_PARAMETERS_PER_VARIABLE * len(shapes)
    )


def _compiled(close, window, asked):
    """`close`, `window`'s, as one XLA computation where XLA compiles it;
    else `close`.

    In a plain graph each element-wise op of the parent's update is a
    kernel of its own with a temporary the size of the variable (Adam:
    about a dozen per variable); XLA fuses the close into a few loops, as
    the optimizers of `tf.keras` before Keras 3 compiled their update.
    The computation writes its variables once it has computed them all.
    A close XLA cannot compile (a Python callback in a schedule or a
    constraint, a device without XLA, variables on several devices), or
    one that holds graph checks XLA would drop (`GRAPH_CHECKS`), runs as
    it is; the latter warns where the user `asked` for `jit_compile=True`.
    """
    if _xla_unsupported_here():
        return close
    with tf.init_scope():
        if not window.total_weight.value.is_initialized():
            # Built in this trace: `tf.function` traces again once its
            # variables exist, and only that trace runs.
            return close
    compiled = tf.function(close, jit_compile=True, autograph=False)
    try:
        with tf.init_scope():
            checks = _graph_checks(compiled.get_concrete_function())
            if not checks:
                compiled.experimental_get_compiler_ir()(stage="hlo")
    except Exception:  # noqa: BLE001 - the plain close raises its own
        return close
    if checks:
        if asked:
            warnings.warn(
                "`jit_compile=True`: the window's close holds graph checks "
                f"({', '.join(sorted(checks))}: a constraint's or a "
                "learning-rate schedule's `tf.debugging` call) that XLA "
                "compiles as nothing; it runs as TensorFlow's ops, which "
                "keep them. Pass `jit_compile=False` to silence this.",
                stacklevel=2,
            )
        return close
    return compiled


# Ops that XLA compiles as nothing (`Assert`) or only on a GPU
# (`CheckNumerics`): a close holding them runs as TensorFlow's ops.
GRAPH_CHECKS = frozenset({"Assert", "CheckNumerics", "CheckNumericsV2"})


def _graph_checks(function):
    """The `GRAPH_CHECKS` ops in the concrete `function`'s graph, and in
    every function it calls (branches of `cond`, bodies of `while_loop`,
    nested `tf.function`s)."""
    graph = function.graph.as_graph_def()
    ops = {node.op for node in graph.node}
    for nested in graph.library.function:
        ops.update(node.op for node in nested.node_def)
    return ops & GRAPH_CHECKS


def _xla_unsupported_here():
    """TensorFlow on a Mac's GPU has no XLA (Keras' `model_supports_jit`)."""
    return (
        platform.system() == "Darwin"
        and "arm" in platform.processor().lower()
        and bool(tf.config.list_physical_devices("GPU"))
    )
