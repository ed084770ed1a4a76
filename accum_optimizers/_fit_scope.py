"""`flush_at_train_end` for the length of one `fit`, ended by an exception
too.

`FlushAccumulation` sets an optimizer's `flush_at_train_end` when training
begins and clears it in `on_train_end`; a `fit` that raises calls no
`on_train_end` (Keras' `fit` has no `finally` for its callbacks on
TensorFlow and torch). So the flag set by a callback is tied to the call
that runs the callbacks (the trainer's `fit`, or a loop of one's own): it
stands while that call runs, and reads `False` once it has returned or
raised.
"""

import sys

import keras


def set_for_this_fit(optimizer):
    """Sets `optimizer.flush_at_train_end` for as long as the call that
    runs the current callback (`fit`) runs."""
    optimizer.__dict__["_flush_at_train_end"] = True
    optimizer.__dict__["_flush_fit_frame"] = _caller_of_callbacks()


def read(optimizer):
    """`optimizer.flush_at_train_end`: `False` where a callback set it for
    a `fit` that has ended (by an exception: its `on_train_end` never
    ran)."""
    state = optimizer.__dict__
    frame = state.get("_flush_fit_frame")
    if frame is not None and not _on_stack(frame):
        # The ended call's frame is let go (it holds its locals).
        clear(optimizer)
    return state.get("_flush_at_train_end", False)


def set_by_hand(optimizer, value):
    """`optimizer.flush_at_train_end = value`: stands until a `fit` ends."""
    optimizer.__dict__["_flush_at_train_end"] = value
    optimizer.__dict__["_flush_fit_frame"] = None


def clear(optimizer):
    set_by_hand(optimizer, False)


def _caller_of_callbacks():
    """The frame of the first caller outside the callbacks (past the
    callback calling this and Keras' `CallbackList`): the trainer's `fit`;
    `None` outside a callback."""
    frame = sys._getframe(1)
    while frame is not None and not _in_callback(frame):
        frame = frame.f_back
    while frame is not None and _in_callback(frame):
        frame = frame.f_back
    return frame


def _in_callback(frame):
    return isinstance(frame.f_locals.get("self"), keras.callbacks.Callback)


def _on_stack(target):
    frame = sys._getframe(1)
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False
