"""`load_training_state`: resume a model whose `.keras` load recompiles it.

Some models' `compile` is their own (keras_hub's tasks: `CausalLM`,
`TextClassifier`, ...), so `keras.saving.load_model` calls it with its
defaults: the model comes back with a fresh `Adam`, not the saved optimizer,
and the saved optimizer state is skipped. Compile the rebuilt model with the
optimizer to resume with, then load the state into it.
"""

from __future__ import annotations

import os

import keras


def load_training_state(
    model: keras.Model, filepath: str | os.PathLike[str]
) -> keras.Model:
    """Loads a saved model's weights and optimizer state into `model`.

    `model` must be compiled with an optimizer of the saved configuration
    (an accumulating optimizer with its `accum_iters`, say); its state, the
    pending window of an accumulating optimizer included, is restored, so
    training resumes exactly where the saved model stopped.

    ```python
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=AdamAccumulate(1e-4, accum_iters=8), loss=...)
    accum_optimizers.load_training_state(model, "lm.keras")
    model.fit(...)  # the next micro-batch completes the saved window
    ```

    Args:
        model: a built and compiled `keras.Model` with the saved model's
            architecture.
        filepath: a `.keras` file (`model.save`) or a `.weights.h5` file
            (`model.save_weights`).

    Returns:
        `model`.

    Raises:
        ValueError: if `model` is not compiled with an optimizer.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "`model` must be compiled with the optimizer to resume with "
            "before its training state is loaded. Received: a model with "
            "optimizer=None"
        )
    # `load_weights` restores optimizer variables only into a built
    # optimizer: an unbuilt one would be skipped.
    optimizer.build(model.trainable_variables)
    model.load_weights(filepath)
    return model
