"""LoRA on the Megatron actor (megatron_bridge.lora): every TP x PP layout computes TP1's function.

Each world builds the tiny Llama (tied embeddings, 4 heads / 2 query groups, SwiGLU) as a trained
MegatronRole with adapters on all four linears, loads the same TP1-layout adapters (B random, so
A's gradients are not zero), and returns: the logits, one SGD step's loss, gradient norm, adapter
gradients and stepped adapters (gathered in TP1 layout), the base weights bit-for-bit before and
after three more Adam steps, and the logits with the adapters switched off next to a LoRA-free
model's. fp32, as tests/distributed/test_megatron_parallel.py.
"""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.test_megatron_parallel import BATCH, MICRO, _batch

RANK, ALPHA = 4, 8.0
TOL = 1e-5


def _spec():
    from megatron_bridge.lora import LoraSpec

    return LoraSpec(rank=RANK, alpha=ALPHA)


def _random_adapters(state: dict) -> dict:
    """The same non-zero TP1-layout adapters in every world: B random (init makes it zero)."""
    gen = torch.Generator().manual_seed(11)
    out = {}
    for name, t in state.items():
        out[name] = torch.randn(t.shape, generator=gen) * 0.05 if name.endswith(".B") else t
    return out


def _role(hf_dir, g, optimizer="sgd", lora=True, fused=False):
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    settings = dict(optimizer="sgd", lr=0.5) if optimizer == "sgd" else dict(optimizer="adam", lr=1e-2, adam_eps=1e-3)
    optim = OptimSettings(clip_grad=0.0, use_distributed_optimizer=optimizer == "adam", **settings)
    return MegatronRole(hf_dir, g, torch.float32, optim=optim, lora=_spec() if lora else None, fused_output=fused)


def _offset(role):
    from megatron_bridge.mappings import layer_offset

    return layer_offset(role.args, role.groups.pp_rank, role.groups.dims.pp)


def _loss_step(role, full):
    """Forward/backward of a token-mean NLL over this DP rank's rows; returns the global loss."""
    from rlstack.collectives import sum_floats
    from rlstack.workers.actor import token_logprobs
    from rlstack.workers.megatron_role import split_micro_batches

    g = role.groups
    per_dp = BATCH // g.dims.dp
    local = {k: v[g.dp_rank * per_dp : (g.dp_rank + 1) * per_dp] for k, v in full.items()}
    total_tokens = sum_floats([float(local["resp_mask"].sum())], g.dp, g.device)[0]
    micro = split_micro_batches(local, MICRO)
    scale = len(micro) * g.dims.dp

    def loss_fn(mb, logits):
        loss = -(token_logprobs(role, mb, logits) * mb["resp_mask"]).sum() / total_tokens
        return loss * scale, {"loss": loss.detach()}

    role.model.train()
    role.model.zero_grad_buffer()
    role.optimizer.zero_grad()
    stats = role.run(micro, loss_fn, forward_only=False)
    return sum_floats([sum(float(s["loss"]) for s in stats)], g.world, g.device)[0] / g.dims.tp


def _logits(role, input_ids):
    from megatron_bridge.verify import megatron_logits

    role.model.eval()
    return megatron_logits(role.module, input_ids, role.groups, role.args.vocab_size)


def _layout_worker(hf_dir, tp, pp, fused=False):
    from megatron_bridge.hf import gather_hf_state_dict
    from megatron_bridge.lora import adapter_state, adapters_disabled, load_adapter_state_, merge_, unmerge_
    from megatron_bridge.parallel import init_distributed

    g = init_distributed(tp, pp)
    role = _role(hf_dir, g, fused=fused)
    off = _offset(role)
    load_adapter_state_(role.module, _random_adapters(adapter_state(role.module, g.tp, g.pp, off)), g.tp, off)
    full = _batch(role.args.vocab_size)
    out = {"logits": _logits(role, full["tokens"])}
    out["loss"] = _loss_step(role, full)
    out["grads"] = adapter_state(role.module, g.tp, g.pp, off, grads=True)
    ok, grad_norm, _ = role.optimizer.step()
    assert ok
    out["grad_norm"] = float(grad_norm)
    out["adapters"] = adapter_state(role.module, g.tp, g.pp, off)
    out["frozen"] = [n for n, p in role.module.named_parameters() if p.requires_grad and ".lora." not in n]
    out["base_before"] = gather_hf_state_dict(role.module, role.args, g)
    for _ in range(3):
        _loss_step(role, full)
        assert role.optimizer.step()[0]
    out["base_after"] = gather_hf_state_dict(role.module, role.args, g)
    out["adapters_after"] = adapter_state(role.module, g.tp, g.pp, off)
    with adapters_disabled(role.module):
        out["logits_off"] = _logits(role, full["tokens"])
    out["logits_trained"] = _logits(role, full["tokens"])
    merge_(role.module)  # W + scale * B @ A in each rank's shard, adapters off
    out["logits_merged"] = _logits(role, full["tokens"])
    unmerge_(role.module)
    out["logits_unmerged"] = _logits(role, full["tokens"])
    base = _role(hf_dir, g, lora=False)
    out["logits_base"] = _logits(base, full["tokens"])
    return out if g.rank == 0 else None


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return run_distributed(_layout_worker, 1, tiny_llama, 1, 1)[0]


def _max_diff(a: dict, b: dict) -> dict:
    assert a.keys() == b.keys()
    return {k: (a[k] - b[k]).abs().max().item() for k in a}


def _check_world(result, exact_off: float = 0.0):
    """What holds inside one world, whatever its layout."""
    assert result["frozen"] == [], f"base weights left trainable: {result['frozen'][:3]}"
    for name, before in result["base_before"].items():
        assert torch.equal(before, result["base_after"][name]), f"base weight {name} changed"
    moved = _max_diff(result["adapters_after"], result["adapters"])
    assert min(moved.values()) > 0, "an adapter did not train"
    off = (result["logits_off"] - result["logits_base"]).abs().max().item()
    assert off <= exact_off, f"adapters off vs the base model: max |logit diff| {off:.2e}"
    assert (result["logits"] - result["logits_base"]).abs().max() > 1e-3  # the adapters do something
    for kind in ("logits_merged", "logits_unmerged"):
        assert (result[kind] - result["logits_trained"]).abs().max() < TOL, kind


def test_tp1_lora_step(reference):
    _check_world(reference)
    names = list(reference["grads"])
    assert len(names) == 2 * 4 * 2  # A and B of 4 linears in each of 2 layers
    assert all(reference["grads"][n].abs().max() > 0 for n in names), "an adapter got no gradient"


@pytest.mark.parametrize(
    "tp,pp,fused",
    [(2, 1, False), (1, 2, False), (2, 2, False), (2, 1, True)],
    ids=["tp2", "pp2", "tp2pp2", "tp2-fused-output"],
)
def test_layouts_equal_tp1(tiny_llama, reference, tp, pp, fused):
    """fused: model.fused_output_logprobs (the default), the LM head frozen inside the fused log-prob."""
    result = run_distributed(_layout_worker, tp * pp, tiny_llama, tp, pp, fused)[0]
    # TP > 1: the base model's trainable linears and the frozen ones reduce in another order
    _check_world(result, exact_off=1e-6)
    assert (result["logits"] - reference["logits"]).abs().max() < TOL
    assert abs(result["loss"] - reference["loss"]) < TOL
    assert abs(result["grad_norm"] - reference["grad_norm"]) < TOL * max(1.0, reference["grad_norm"])
    for kind in ("grads", "adapters"):
        worst = max(_max_diff(result[kind], reference[kind]).items(), key=lambda kv: kv[1])
        assert worst[1] < TOL, f"TP{tp} x PP{pp} {kind} {worst[0]}: max abs diff {worst[1]:.2e}"
        print(f"TP{tp} x PP{pp} {kind}: max abs diff {worst[1]:.1e}")
    print(f"TP{tp} x PP{pp} logits: max abs diff {(result['logits'] - reference['logits']).abs().max():.1e}")


# ---------------------------------------------------------------- optimizer state per rank


def _state_bytes(optimizer) -> int:
    total = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    return total


def _grad_buffer_numel(ddp) -> int:
    return sum(b.grad_data.numel() for b in ddp.buffers)


def test_optimizer_state_holds_adapters_only(tiny_llama):
    per_rank = run_distributed(_optimizer_state_worker, 2, tiny_llama)
    full = [r[False] for r in per_rank]
    lora = [r[True] for r in per_rank]
    params, adapter_params = full[0]["params"], lora[0]["adapters"]
    assert adapter_params == _planned_adapters(tiny_llama)  # the memory planner counts what megatron holds
    # Adam keeps exp_avg and exp_avg_sq (fp32) of this rank's shard; summed over DP the full count
    assert sum(r["state_bytes"] for r in full) == 2 * 4 * params
    assert sum(r["state_bytes"] for r in lora) == 2 * 4 * adapter_params
    ratio = sum(r["state_bytes"] for r in lora) / sum(r["state_bytes"] for r in full)
    assert ratio == pytest.approx(adapter_params / params, rel=1e-12)
    for f, lo in zip(full, lora):  # each rank holds about half (bucket padding aside)
        assert lo["state_bytes"] == pytest.approx(4 * adapter_params, rel=0.05)
        assert f["state_bytes"] == pytest.approx(4 * params, rel=0.05)
        assert lo["grad_buffer"] < 2 * adapter_params < f["grad_buffer"]  # no gradient buffer for the base
    print(f"optimizer state per rank: {full[0]['state_bytes']} B full, {lora[0]['state_bytes']} B LoRA")


def _planned_adapters(hf_dir) -> int:
    from megatron_bridge.hf import read_model_args
    from rlstack.planner import memory as m
    from rlstack.planner.shapes import shape_of

    return m.stage_lora_params(shape_of(read_model_args(hf_dir), 1), 1, 1, RANK)


def _optimizer_state_worker(hf_dir):
    """DP2, distributed Adam: state bytes and counts on this rank, without and with LoRA."""
    from megatron_bridge.lora import count_adapter_params
    from megatron_bridge.parallel import init_distributed

    g = init_distributed(1, 1)
    out = {}
    for lora in (False, True):
        role = _role(hf_dir, g, optimizer="adam", lora=lora)
        _loss_step(role, _batch(role.args.vocab_size))
        assert role.optimizer.step()[0]
        named = dict(role.module.named_parameters())
        out[lora] = {
            "state_bytes": _state_bytes(role.optimizer),
            "grad_buffer": _grad_buffer_numel(role.model),
            "params": sum(p.numel() for n, p in named.items() if ".lora." not in n),
            "adapters": count_adapter_params(role.module),
        }
    return out


# ---------------------------------------------------------------- dist checkpoint of the adapters


def _checkpoint_worker(hf_dir, path, layouts):
    """Save a trained LoRA actor (with its optimizer) at the first layout, load it at each other one:
    the adapters in TP1 layout, per layout."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.lora import adapter_state, load_adapter_state_
    from megatron_bridge.parallel import init_distributed
    from rlstack.checkpoint import load_role, save_role

    out = []
    for i, (tp, pp) in enumerate(layouts):
        g = init_distributed(tp, pp)
        role = _role(hf_dir, g, optimizer="adam")
        off = _offset(role)
        if i == 0:
            load_adapter_state_(role.module, _random_adapters(adapter_state(role.module, g.tp, g.pp, off)), g.tp, off)
            _loss_step(role, _batch(role.args.vocab_size))
            assert role.optimizer.step()[0]
            save_role(role, path, g, with_optimizer=True)
        else:
            load_role(role, path, with_optimizer=True)
        out.append(adapter_state(role.module, g.tp, g.pp, off))
        ps.destroy_model_parallel()
    return out


def test_adapters_checkpoint_at_tp2_load_at_tp1_and_pp2(tiny_llama, tmp_path):
    """megatron dist checkpointing of the adapters and their Adam state: saved at TP2, loaded (and
    resharded) at TP1 x DP2 and PP2: the same adapters."""
    (tmp_path / "ckpt").mkdir()
    per_rank = run_distributed(
        _checkpoint_worker, 2, tiny_llama, str(tmp_path / "ckpt"), [(2, 1), (1, 1), (1, 2)], timeout=120
    )
    saved, *loaded = per_rank[0]
    assert any(t.abs().max() > 0 for n, t in saved.items() if n.endswith(".B"))
    for state in loaded:
        assert _max_diff(state, saved) == dict.fromkeys(saved, 0.0)
