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


# ----------------------------------------------------------------------------- resources

RESOURCE_EXIT = 3  # ran out of memory or disk: neither the user's input nor a bug
_plan = {"line": ""}  # the memory plan's one-line summary, once a run has one (train.py)


def remember_plan(summary: str) -> None:
    _plan["line"] = summary


def resource_message(e: BaseException) -> str:
    """One line for an exhausted resource found anywhere in `e`'s chain (host or GPU memory, disk
    space or quota), naming what ran out, what the plan needed and the setting to change; "" if none."""
    import errno

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if getattr(e, "resource_line", ""):  # a message written where the fault was understood (checkpoint.py)
            return e.resource_line
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in text.lower():
            what = "GPU memory" if "CUDA" in text or type(e).__name__ == "OutOfMemoryError" else "host memory"
            planned = f" ({_plan['line'].removeprefix('memory plan: ')})" if _plan["line"] else ""
            return (
                f"out of {what}{planned}: lower algorithm.micro_batch_size or rollout.micro_batch_size, "
                "set model.gradient_checkpointing=true, or add ranks; `--validate-only` prints the plan"
            )
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            where = e.filename or "the output directory"
            kind = "disk quota exceeded" if e.errno == errno.EDQUOT else "no space left on the device"
            return (
                f"{kind} writing {where}: free space there or point trainer.output_dir / checkpoint.dir "
                "at a file system with room (a checkpoint's size is logged at each save)"
            )
        e = e.__cause__ or e.__context__
    return ""
