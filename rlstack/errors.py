"""User mistakes versus bugs.

`UserError` (and the bridge's `InputError`, its base) is raised only where the user can fix the
input: a config key, a data file, a path, a checkpoint, a command-line flag. The entry points print
it as one line naming the file or key and the fix, and exit 2. Every other exception is a bug: its
traceback is shown once and the run says so.
"""

from megatron_bridge.errors import InputError


class UserError(InputError):
    """A mistake the user can fix; the message names the file or key and the fix."""


USER_ERRORS = (InputError,)
