"""rlstack.from_verl: each verl key lands on its own rlstack key.

A mapping slip (a verl key sent onto a neighbour's rlstack key, e.g. clip_ratio_high onto
algorithm.clip_ratio_low) passes every test that sets one key of the pair. Here each verl key the
translator knows is given alone, and the rlstack keys whose comment names it are collected: two
verl keys on one rlstack key must be a group `from_verl.SHARED_TARGETS` declares.
"""

from collections import defaultdict

from rlstack import from_verl
from rlstack.config import load_config

ACTOR = from_verl.ACTOR
# Keys whose value must be one of a few words or a list (a number would be refused as unsupported).
VALID = {
    "data.train_files": ["train.parquet"],
    "data.val_files": ["test.parquet"],
    "trainer.logger": ["console"],
    from_verl.ROLLOUT + "name": "vllm",
    ACTOR + "optim.lr_scheduler_type": "cosine",
    ACTOR + "optim.warmup_style": "cosine",
    ACTOR + "policy_loss.loss_mode": "gspo",
    ACTOR + "loss_agg_mode": "seq-mean-token-mean",
    "critic.loss_agg_mode": "seq-mean-token-mean",
    "algorithm.adv_estimator": "grpo",
    "algorithm.norm_adv_by_std_in_grpo": False,
    "reward.reward_manager.name": "batch",
    "reward_model.reward_manager": "batch",
    "trainer.resume_mode": "auto",
}


def _targets_of_each_key() -> dict[str, set[str]]:
    """rlstack key -> the verl keys that, given alone, land on it (the source comment names them)."""
    landed = defaultdict(set)
    for i, key in enumerate(sorted(set(from_verl.DIRECT) | set(from_verl.SPECIAL))):
        value = VALID.get(key, 3 + i)  # a value of its own: a key copying another's shows
        t = from_verl.translate({key: value})
        for target, source in t.sources.items():
            if f"verl {key}=" in source:
                landed[target].add(key)
    return landed


def test_no_two_verl_keys_share_an_rlstack_key_unless_declared():
    landed = _targets_of_each_key()
    for key, target in from_verl.DIRECT.items():  # the probe reaches every key of the plain table
        assert key in landed[target], f"verl {key} given alone does not land on {target}"
    shared = {target: keys for target, keys in landed.items() if len(keys) > 1}
    for target, keys in sorted(shared.items()):
        declared = from_verl.SHARED_TARGETS.get(target, frozenset())
        assert keys == declared, (
            f"{sorted(keys)} all translate onto {target}; from_verl.SHARED_TARGETS declares {sorted(declared)}"
        )
    stale = sorted(set(from_verl.SHARED_TARGETS) - set(shared))
    assert not stale, f"SHARED_TARGETS declares groups no translation produces: {stale}"


def test_clip_ratio_low_and_high_land_in_their_own_fields(tmp_path):
    command = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.clip_ratio=0.25",  # the combined ratio: the specific ones win
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "trainer.total_training_steps=2",
    ]
    t = from_verl.translate(from_verl.parse_command_line(command))
    assert t.values["algorithm.clip_ratio_low"] == 0.2 and t.values["algorithm.clip_ratio_high"] == 0.28
    assert t.sources["algorithm.clip_ratio_high"] == "verl actor_rollout_ref.actor.clip_ratio_high=0.28"
    out = tmp_path / "grpo.yaml"
    out.write_text(from_verl.to_yaml_text(t))
    algo = load_config(str(out), ["data.synthetic=copy"]).algorithm  # the YAML rlstack reads back
    assert (algo.clip_ratio_low, algo.clip_ratio_high) == (0.2, 0.28)
