"""The one exception type for mistakes in what a caller hands the bridge.

`InputError` means the input can be fixed by whoever passed it (a path, a checkpoint, a layout,
a model config); its message names the thing and the fix. Anything else the bridge raises is a
bug. Applications built on the bridge (rlstack) report `InputError` as a one-line user error and
everything else with its traceback.
"""


class InputError(ValueError):
    """A fixable mistake in the caller's input; the message names the file or option and the fix."""
