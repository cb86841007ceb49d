"""The megatron-core versions the patches were written for, checked once at start-up.

Every patch in this package names call sites in megatron-core's source (registry.py) and most
reach into private names; a release that moved one would fail late and obscurely (a NameError in
the first backward, a wrong gradient). So a version outside `SUPPORTED_MEGATRON` stops the start
with one line, unless the caller explicitly accepts an untested version (then a warning).
setup.py pins the same version.
"""

from __future__ import annotations

import logging

from megatron_bridge.errors import InputError

log = logging.getLogger("megatron_bridge")

SUPPORTED_MEGATRON = ("0.16.1",)


class UnsupportedMegatronError(InputError):
    """The installed megatron-core is not a version the patches were written for."""


def installed_megatron() -> str:
    from megatron_bridge.patches.lazy_compile import lazy_torch_compile

    with lazy_torch_compile():  # megatron's first import: its 38 jit_fuser kernels set up at first call
        import megatron.core

    return str(megatron.core.__version__)


def check_megatron_version(allow_untested: bool = False, setting: str = "allow_untested_megatron=True") -> str:
    """The installed version; raises UnsupportedMegatronError (or, with `allow_untested`, warns)
    when it is not in SUPPORTED_MEGATRON. `setting` is how the caller's user accepts it."""
    version = installed_megatron()
    if version in SUPPORTED_MEGATRON:
        return version
    message = (
        f"megatron-core {version} is installed, but megatron_bridge's patches were written for megatron-core "
        f"{', '.join(SUPPORTED_MEGATRON)}: install megatron-core=={SUPPORTED_MEGATRON[-1]}"
    )
    if not allow_untested:
        raise UnsupportedMegatronError(f"{message}, or set {setting} to run on an untested version")
    log.warning("%s (%s: running on an untested version)", message, setting)
    return version
