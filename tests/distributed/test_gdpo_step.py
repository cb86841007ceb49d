"""gdpo with algorithm.gdpo_reward_keys through the trainer on two data-parallel ranks: each row's
components are the custom reward function's dict values under the keys ("score" its score), and
the advantages are the pure gdpo function's over the whole batch (both ranks: the final whitening is
global); a key the function does not return stops the step with a one-line UserError naming it.
"""

from __future__ import annotations

from tests.dist_utils import run_distributed

CONFIG = "yaml_configs/tiny_cpu.yaml"
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    text = solution_str.strip()
    return {"score": float(text == str(ground_truth).strip()), "chars": len(solution_str), "short": float(len(text) < 3)}
"""


def _worker(out_dir: str, cache: str, reward_file: str):
    import torch

    from megatron_bridge.parallel import init_distributed
    from rlstack.config import load_config
    from rlstack.errors import UserError
    from rlstack.trainer import build_trainer

    overrides = [
        f"trainer.output_dir={out_dir}",
        f"model.cache_dir={cache}",
        f"data.reward_fn_file={reward_file}",
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[chars,short,score]",
        "algorithm.gdpo_reward_weights=[1.0,0.5,2.0]",
        "data.train_batch_size=4",
        "rollout.n=4",
        "rollout.max_new_tokens=3",
        "algorithm.micro_batch_size=8",
        "algorithm.use_kl_loss=false",
        "logging.progress=false",
    ]
    cfg = load_config(CONFIG, overrides)
    p = cfg.parallel
    groups = init_distributed(p.tp, p.pp, p.dp, "gloo", 5, seed=cfg.trainer.seed)
    trainer = build_trainer(cfg, groups)
    seen = []
    inner = trainer.source.next_batch

    def capture(step):
        batch = inner(step)
        seen.append(batch)
        return batch

    trainer.source.next_batch = capture
    trainer.train_step()
    batch = seen[0]
    r, n = batch.rollout, batch.rollout.num_sequences
    by_hand = torch.tensor(
        [[float(x.extras["chars"]), float(x.extras["short"]), x.score] for x in batch.scores.results]
    ).T  # [3, n]
    out = {
        "components": r.reward_components[:, :n].cpu(),
        "by_hand": by_hand,
        "group_ids": r.group_ids[:n].cpu(),
        "mask": r.resp_mask[:n].cpu(),
        "advantages": r.advantages[:n].cpu(),
    }
    cfg.algorithm.gdpo_reward_keys = ["chars", "acc", "short"]  # "acc" is not returned
    try:
        trainer.train_step()
        out["error"] = None
    except UserError as e:
        out["error"] = str(e)
    trainer.engine.close()
    return out


def test_gdpo_keys_reach_the_advantages(tmp_path, tiny_cache):
    import torch

    from rlstack.algorithms.advantage_variants import gdpo

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    ranks = run_distributed(_worker, 2, str(tmp_path / "run"), tiny_cache, str(reward), timeout=150)
    for out in ranks:
        assert torch.equal(out["components"], out["by_hand"])
        assert "'acc'" in out["error"] and "\n" not in out["error"], out["error"]
        assert "gdpo_reward_keys" in out["error"]
    # the pure function over both ranks' rows (group ids made unique per rank), whitened globally
    comps = torch.cat([o["components"] for o in ranks], 1)
    ids = torch.cat([o["group_ids"] + 1000 * k for k, o in enumerate(ranks)])
    width = max(o["mask"].shape[1] for o in ranks)
    mask = torch.cat([torch.nn.functional.pad(o["mask"], (0, width - o["mask"].shape[1])) for o in ranks])
    want = gdpo(comps, ids, mask, weights=[1.0, 0.5, 2.0])
    got = torch.cat([torch.nn.functional.pad(o["advantages"], (0, width - o["advantages"].shape[1])) for o in ranks])
    diff = float((got - want).abs().max())
    print(f"gdpo trainer vs pure function over both DP ranks: max abs diff {diff:.3g}")
    assert diff < 1e-5 and float(want.abs().max()) > 0.1
    assert float(comps[0].std()) > 0  # the chars component varies: the check is not on zeros
