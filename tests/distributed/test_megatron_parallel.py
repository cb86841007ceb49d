"""Megatron-Core on CPU/gloo: TP, PP, TP x PP and DP (DDP, distributed optimizer on/off) give the
same loss, gradients and post-step weights as the same weights at TP1 x PP1 on one rank.

Each run builds the tiny Llama through the bridge, runs one SGD step (Adam's first step is sign-like, so float noise on near-zero gradients
would flip whole updates and hide real errors) of a token-mean
cross-entropy over megatron's forward-backward schedule (4 micro-batches), and returns the
HF-named gradients and updated weights gathered on rank 0.
"""

import pytest
import torch

from tests.dist_utils import run_distributed

BATCH, SEQ, MICRO = 8, 12, 2


def _batch(vocab: int) -> dict:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ)
    mask[:, :3] = 0  # "prompt" tokens carry no loss
    mask[1, 9:] = 0  # a shorter sequence
    return {"tokens": tokens, "position_ids": torch.arange(SEQ).expand(BATCH, -1).contiguous(), "resp_mask": mask}


OPTIMIZERS = {
    "sgd": dict(optimizer="sgd", lr=0.5),
    # eps >> float noise keeps Adam's first update a smooth function of the gradient
    "adam": dict(optimizer="adam", lr=1e-2, adam_eps=1e-3),
}


def _train_one_step(
    hf_dir: str, tp: int, pp: int, use_dist_opt: bool, optimizer: str = "sgd", fused: bool = False, recompute=False
):
    from megatron_bridge.hf import gather_hf_state_dict
    from megatron_bridge.parallel import init_distributed
    from rlstack.collectives import sum_floats
    from rlstack.workers.actor import token_logprobs
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings, split_micro_batches

    g = init_distributed(tp, pp)
    role = MegatronRole(
        hf_dir,
        g,
        torch.float32,
        optim=OptimSettings(clip_grad=0.0, use_distributed_optimizer=use_dist_opt, **OPTIMIZERS[optimizer]),
        fused_output=fused,
        recompute=recompute,
    )
    full = _batch(role.args.vocab_size)
    per_dp = BATCH // g.dims.dp
    local = {k: v[g.dp_rank * per_dp : (g.dp_rank + 1) * per_dp] for k, v in full.items()}
    total_tokens = sum_floats([float(local["resp_mask"].sum())], g.dp, g.device)[0]
    micro = split_micro_batches(local, MICRO)
    scale = len(micro) * g.dims.dp

    def loss_fn(mb, logits):
        lp = token_logprobs(role, mb, logits)
        loss = -(lp * mb["resp_mask"]).sum() / total_tokens
        return loss * scale, {"loss": loss.detach()}

    role.model.zero_grad_buffer()
    role.optimizer.zero_grad()
    stats = role.run(micro, loss_fn, forward_only=False)
    loss = sum_floats([sum(float(s["loss"]) for s in stats)], g.world, g.device)[0] / tp
    grads = _gathered_grads(role, g)
    ok, grad_norm, _ = role.optimizer.step()
    assert ok
    weights = gather_hf_state_dict(role.module, role.args, g)
    if g.rank != 0:
        return None
    groups = [
        group for opt in getattr(role.optimizer, "chained_optimizers", [role.optimizer]) for group in opt.param_groups
    ]
    fused_adam = optimizer == "adam" and all(group.get("fused") for group in groups)
    return {"loss": loss, "grads": grads, "weights": weights, "grad_norm": float(grad_norm), "fused_adam": fused_adam}


def _gathered_grads(role, g):
    """HF-named full gradients: swap each parameter's data with its DDP main_grad, then export."""
    from megatron_bridge.hf import gather_hf_state_dict

    params = list(role.module.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.to(p.dtype)
    try:
        return gather_hf_state_dict(role.module, role.args, g)
    finally:
        for p, d in zip(params, saved):
            p.data = d


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return run_distributed(_train_one_step, 1, tiny_llama, 1, 1, False)[0]


def _assert_close(result, reference, atol=1e-5, kinds=("grads", "weights")):
    assert abs(result["loss"] - reference["loss"]) < atol, (result["loss"], reference["loss"])
    # megatron's norm (what clipping uses) counts every TP shard once
    assert abs(result["grad_norm"] - reference["grad_norm"]) < 1e-5 * max(1.0, reference["grad_norm"])
    for kind in kinds:
        assert result[kind].keys() == reference[kind].keys()
        for name, expected in reference[kind].items():
            diff = (result[kind][name] - expected).abs().max().item()
            assert diff < atol, f"{kind} {name}: max abs diff {diff}"


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_tp_pp_match_single_rank(tiny_llama, reference, tp, pp):
    result = run_distributed(_train_one_step, tp * pp, tiny_llama, tp, pp, False)[0]
    _assert_close(result, reference)


def test_dp2_step_equals_full_batch_step(tiny_llama, reference):
    result = run_distributed(_train_one_step, 2, tiny_llama, 1, 1, False)[0]
    _assert_close(result, reference)


def test_dp2_distributed_optimizer_adam_equals_full_batch(tiny_llama):
    # megatron's distributed optimizer supports Adam only
    single = run_distributed(_train_one_step, 1, tiny_llama, 1, 1, False, "adam")[0]
    sharded = run_distributed(_train_one_step, 2, tiny_llama, 1, 1, True, "adam")[0]
    # grads are reduce-scattered: each rank's buffer is exact only on its own shard, so compare
    # the loss and the updated (all-gathered) weights
    _assert_close(sharded, single, kinds=("weights",))
    assert single["fused_adam"] and sharded["fused_adam"]  # torch's fused CPU kernel (megatron_role)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_fused_output_layer_matches_single_rank(tiny_llama, reference, tp, pp):
    """model.fused_output_logprobs (the LM head multiplied inside the log-prob, tied embedding): the
    same loss, gradients (the tied embedding's two contributions, the decoder's through the TP
    region) and stepped weights as megatron's own output layer on one rank."""
    result = run_distributed(_train_one_step, tp * pp, tiny_llama, tp, pp, False, "sgd", True)[0]
    _assert_close(result, reference)


def test_fused_output_layer_untied_tp2(tiny_qwen2):
    """An untied LM head (`output_layer.weight`, its own gradient) at TP2 against TP1 unfused."""
    single = run_distributed(_train_one_step, 1, tiny_qwen2, 1, 1, False)[0]
    fused = run_distributed(_train_one_step, 2, tiny_qwen2, 2, 1, False, "sgd", True)[0]
    _assert_close(fused, single)


def test_reference_step_changes_weights(tiny_llama, reference):
    from safetensors.torch import load_file

    original = load_file(f"{tiny_llama}/model.safetensors")
    moved = max((reference["weights"][k] - v).abs().max().item() for k, v in original.items())
    assert moved > 1e-4  # the step is real, so the equalities above are not vacuous
    assert reference["loss"] > 0
    full_norm = sum(g.double().pow(2).sum() for g in reference["grads"].values()).sqrt().item()
    assert abs(reference["grad_norm"] - full_norm) < 1e-5 * full_norm


@pytest.mark.parametrize(
    "recompute", [True, ("layernorm", "mlp"), ("layernorm", "mlp_act")], ids=["full", "selective", "mlp_act"]
)
def test_recompute_gives_the_same_step(tiny_llama, reference, recompute):
    """model.gradient_checkpointing (megatron's full recompute) and model.recompute_modules
    (selective: the norms' outputs discarded and rebuilt, patches.missing_te (m); the MLP checkpointed)
    rebuild the same tensors in backward: the same loss and gradients, bit for bit, on one rank."""
    result = run_distributed(_train_one_step, 1, tiny_llama, 1, 1, False, "sgd", False, recompute)[0]
    assert result["loss"] == reference["loss"]
    for kind in ("grads", "weights"):
        for name, expected in reference[kind].items():
            assert torch.equal(result[kind][name], expected), (kind, name)


@pytest.mark.parametrize("modules", [("layernorm", "mlp"), ("mlp_act",)])
def test_selective_recompute_tp2_fused_head(tiny_llama, reference, modules):
    """Selective recompute across TP (the MLP's row-parallel all-reduce re-run in backward; the
    product's recompute hooked on fc2's all-reduced output) with the fused LM head: the single-rank step."""
    result = run_distributed(_train_one_step, 2, tiny_llama, 2, 1, False, "sgd", True, modules)[0]
    _assert_close(result, reference)
