"""rlstack.rollout.host_cores: a rank waiting for the others' rollout lends its threads to a rank of its
host still decoding, and gets nothing back but its own table entry when it stops waiting."""

import os
import time

import torch

from tests.dist_utils import run_distributed


def _lend(switch: str) -> dict:
    import torch.distributed as dist

    from rlstack.rollout.host_cores import HostCores

    os.environ["RLSTACK_LEND_CORES"] = switch
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    cores = HostCores.open(dist.group.WORLD, rank, torch.device("cpu"))
    out = {"opened": cores is not None, "left_in_shm": [n for n in os.listdir("/dev/shm") if "rlstack-cores-" in n]}
    if cores is None:
        dist.barrier()
        dist.destroy_process_group()
        return out
    if rank == 1:  # done with its rows: waits for rank 0 (as in stages.generate's gather)
        with cores.waiting():
            dist.barrier()
        out["after_wait"] = int(cores.table[1, 1])
    else:  # still decoding
        deadline = time.monotonic() + 30
        while int(cores.table[1, 1]) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        cores.cores = 2  # room for both ranks' threads, whatever this machine has
        cores.take()
        out["threads_while_lent"] = torch.get_num_threads()
        cores.cores = 1  # a host whose cores the ranks already fill: nothing to take
        cores.take()
        out["threads_without_room"] = torch.get_num_threads()
        cores.cores = 2
        cores.take()
        cores.give_back()
        out["threads_after"] = torch.get_num_threads()
        dist.barrier()  # rank 1 stops waiting
    dist.barrier()
    if rank == 0:
        cores.take()  # nobody lends now
        out["threads_unlent"] = torch.get_num_threads()
    dist.destroy_process_group()
    return out


def test_a_waiting_rank_lends_its_threads_to_a_decoding_one():
    r0, r1 = run_distributed(_lend, 2, "1")
    assert r0["opened"] and r1["opened"] and r0["left_in_shm"] == [] == r1["left_in_shm"], (r0, r1)
    assert r0["threads_while_lent"] == 2 and r0["threads_after"] == 1 and r0["threads_unlent"] == 1, r0
    assert r0["threads_without_room"] == 1, r0
    assert r1["after_wait"] == 0, r1


def test_lending_off():
    r0, r1 = run_distributed(_lend, 2, "0")
    assert not r0["opened"] and not r1["opened"], (r0, r1)
