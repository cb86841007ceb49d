#!/usr/bin/env bash
# Best effort: put gperftools' tcmalloc on this machine, the host allocator of rlstack's CPU runs
# (parallel.host_allocator, docs/memory.md). Called by `make install`; never fails the install:
# without the library rlstack runs on glibc's allocator (the same results, a slower update).
set -uo pipefail

have() { ldconfig -p 2>/dev/null | grep -q 'libtcmalloc\(_minimal\)\?\.so'; }
if have; then exit 0; fi
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  if sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    echo "note: no tcmalloc and no root to install it: rlstack uses glibc's allocator (install libtcmalloc-minimal4 for a faster CPU update)" >&2
    exit 0
  fi
fi
if command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; }
elif command -v dnf >/dev/null; then
  $sudo dnf install -y -q gperftools-libs >/dev/null 2>&1
fi
if have; then echo "installed tcmalloc (host allocator for CPU runs)"; else
  echo "note: could not install tcmalloc: rlstack uses glibc's allocator (install libtcmalloc-minimal4 for a faster CPU update)" >&2
fi
exit 0
