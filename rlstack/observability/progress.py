"""Progress bars (tqdm) for rollout and validation: rank 0 only, and only when enabled."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Optional, Union

from tqdm import tqdm

from rlstack.observability.logging import current_rank

# Off a terminal (SLURM logs, `> file`) each redraw is a new line: redraw rarely there.
NON_TTY_MININTERVAL_S = 30.0


PROGRESS_DELAY_S = 2.0


def progress(
    iterable_or_total: Union[Iterable, int],
    desc: str,
    enabled: bool = True,
    rank: Optional[int] = None,
    unit: str = "it",
) -> tqdm:
    """A tqdm bar over an iterable, or over a count advanced with `.update(n)`.

    Disabled (enabled=False, or rank != 0; rank defaults to setup_logging's): a tqdm with
    disable=True, so iteration, update(), set_postfix() and close() work and print nothing.
    The bar is cleared when done (leave=False): the step line that follows is the record.
    """
    rank = current_rank() if rank is None else rank
    stream = sys.stderr
    is_tty = getattr(stream, "isatty", lambda: False)()
    # Off the terminal (torchrun's --tee, a log file) a bar is fragments between prefixed lines.
    disable = not enabled or rank != 0 or not is_tty
    if isinstance(iterable_or_total, int) and not isinstance(iterable_or_total, bool):
        iterable, total = None, iterable_or_total
    else:
        iterable, total = iterable_or_total, None
    mininterval = 0.1 if is_tty else NON_TTY_MININTERVAL_S
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        disable=disable,
        leave=False,
        file=stream,
        mininterval=mininterval,
        dynamic_ncols=True,
        delay=PROGRESS_DELAY_S,  # a stage shorter than this shows no bar at all
    )
