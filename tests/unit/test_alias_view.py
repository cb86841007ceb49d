"""`reshard.alias_view`: every HF tensor at training TP1 x PP1 is a view of its Megatron parameter.

Pure (no process group): Megatron parameters are cut from random HF tensors by `layouts.megatron_shard`;
each engine tensor's view (plain, or grouped [G, R, ...] for q / k / v inside the per-group fused QKV)
must equal the HF tensor and share the parameter's storage. GQA with a padded vocabulary, and
Qwen2's untied head with QKV bias.
"""

import pytest
import torch

from megatron_bridge import layouts
from megatron_bridge.hf_config import ModelArgs
from megatron_bridge.mappings import param_maps
from megatron_bridge.reshard import alias_view, plan_reshard


def _args(tied=True, qkv_bias=False, arch="llama", vocab=300):
    return ModelArgs(
        arch=arch,
        vocab_size=vocab,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=48,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        qkv_bias=qkv_bias,
    )


@pytest.mark.parametrize("args", [_args(), _args(tied=False, qkv_bias=True, arch="qwen2", vocab=250)])
def test_views_equal_the_hf_tensors_and_share_storage(args):
    gen = torch.Generator().manual_seed(0)
    maps = [m for m in param_maps(args) if m.export]
    hf = {n: torch.randn(s, generator=gen) for m in maps for n, s in zip(m.hf, m.hf_shapes)}
    params = {m.megatron: layouts.megatron_shard(m.transform, [hf[n] for n in m.hf], 0, 1, args) for m in maps}
    plan = plan_reshard(args, 1, 1, 1, "hf")
    grouped = 0
    for t in plan.tensors(0):
        source = params[t.spans[0].src]
        view = alias_view(t, source)
        assert view is not None, t.name
        assert view.untyped_storage().data_ptr() == source.untyped_storage().data_ptr(), t.name
        if tuple(view.shape) != t.shape:  # grouped: [G, R, ...] stands for [G*R, ...]
            grouped += 1
            assert view.shape[0] == args.num_query_groups, t.name
            view = view.reshape(t.shape)
        torch.testing.assert_close(view, hf[t.name], rtol=0, atol=0, msg=t.name)
    assert grouped == 3 * args.num_layers * (2 if args.qkv_bias else 1)


def test_no_view_for_a_non_contiguous_source_or_other_rows():
    args = _args()
    plan = plan_reshard(args, 1, 1, 1, "hf")
    t = next(t for t in plan.tensors(0) if t.name.endswith("mlp.down_proj.weight"))
    assert alias_view(t, torch.zeros(t.shape).t().contiguous().t()) is None  # column-major storage
    assert alias_view(t, torch.zeros(t.shape[0], t.shape[1] * 2)) is None  # a wider parameter
