"""Partial rollouts (rlstack/rollout/partial.py) on a real (tiny, random) transformers model: a sample
interrupted by a weight update finishes under the new weights and its tokens keep their versions;
tokens too old are masked out of the loss; the in-flight queue resumes exactly from its saved state."""

import json
from types import SimpleNamespace

import torch

from rlstack.config import RolloutConfig
from rlstack.placement import RolloutBatch
from rlstack.rollout.base import Generation
from rlstack.rollout.hf_engine import HFEngine
from rlstack.rollout.partial import PartialQueue, chunk_tokens, interrupted_share, mask_older

PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65]]
CFG = RolloutConfig(n=2, max_new_tokens=6, staleness=2, partial=True, partial_chunk_tokens=2, micro_batch_size=32)
ONE_REPLICA = SimpleNamespace(dims=SimpleNamespace(world_size=1), rank=0)


def _engine(model_dir):
    return HFEngine(model_dir, SimpleNamespace(micro_batch_size=32, pack_weights=True), "cpu", -1, 0, seed=0)


def _new_weights(engine) -> dict:
    """Weights version 1: every parameter moved, as an update would (deterministic)."""
    g = torch.Generator().manual_seed(1)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in engine.param_targets().items()}


def _logprobs(engine, ids: list, start: int) -> list:
    """log p(ids[i] | ids[:i]) for i >= start under the engine's current weights (temperature 1)."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids])).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits, -1)
    return [logp[i - 1, ids[i]].item() for i in range(start, len(ids))]


def test_an_interrupted_sample_finishes_under_the_new_weights(model_dir):
    engine = _engine(model_dir)
    queue = PartialQueue(CFG, ONE_REPLICA, engine)
    queue.weights(0)
    queue.request(PROMPTS, seed_step=1, version=0, waited=0.0)  # 2 tokens of each sample under version 0
    old = {n: p.detach().clone() for n, p in engine.param_targets().items()}
    engine.load_weights(_new_weights(engine).items())
    engine.weights_updated()
    queue.weights(1)  # the update interrupts the batch: 2 more tokens each under version 1
    batch = RolloutBatch(*queue.finish_oldest())  # the rest (2 tokens each) under version 1
    assert len(batch.gens) == 6 and batch.version == 0
    assert interrupted_share(batch.gens) == 1.0
    rows = [(g, g.prompt_ids + g.response_ids, len(g.prompt_ids)) for g in batch.gens]
    new_lps = [_logprobs(engine, ids, p) for _, ids, p in rows]
    engine.load_weights(old.items())
    for (g, ids, p), new_lp in zip(rows, new_lps):
        assert g.versions == [0, 0, 1, 1, 1, 1] and len(g.response_ids) == 6  # eos -1: none stops early
        assert g.prompt_ids == PROMPTS[g.prompt_index]
        old_lp = _logprobs(engine, ids, p)
        torch.testing.assert_close(torch.tensor(g.logprobs[:2]), torch.tensor(old_lp[:2]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(g.logprobs[2:]), torch.tensor(new_lp[2:]), rtol=1e-4, atol=1e-4)
        assert max(abs(a - b) for a, b in zip(old_lp[2:], new_lp[2:])) > 1e-3  # the two versions differ


def test_the_queue_saved_in_flight_resumes_exactly(model_dir):
    """The state saved with a checkpoint (JSON) restored into a fresh engine continues bit for bit."""
    runs = []
    for resumed in (False, True):
        engine = _engine(model_dir)
        queue = PartialQueue(CFG, ONE_REPLICA, engine)
        queue.weights(0)
        queue.request(PROMPTS, seed_step=1, version=0, waited=0.0)
        engine.generate([[1, 2, 3]], _params())  # another call in between: the sampler moved on
        if resumed:
            state = json.loads(json.dumps(queue.state()))
            engine = _engine(model_dir)  # a restarted rollout rank: fresh engine, fresh sampler
            queue = PartialQueue(CFG, ONE_REPLICA, engine)
            queue.restore([state])
        engine.load_weights(_new_weights(engine).items())
        queue.weights(1)
        runs.append([(g.response_ids, g.logprobs, g.versions) for g in queue.finish_oldest()[0]])
    assert runs[0] == runs[1]


def _params():
    from rlstack.rollout.interface import SamplingParams

    return SamplingParams(n=1, max_new_tokens=3, seed=12345)


def _gen(versions, mask=None):
    return Generation(0, [1], list(range(len(versions))), [0.0] * len(versions), "length", mask, None, versions)


def test_tokens_older_than_the_setting_are_masked_and_counted():
    gens = [_gen([1, 1, 2, 3]), _gen([3, 3]), _gen([2, 3], mask=[0, 1]), _gen([0, 0, 0])]
    out, frac = mask_older(gens, older_than=1)  # behind the sample's last token: 2, 2, 1, 0 | 0, 0 | 1, 0 | 0 x 3
    assert [g.response_mask for g in out] == [[0, 0, 1, 1], None, [0, 1], None]
    assert frac == 2 / 11
    out, frac = mask_older(gens, older_than=0)  # slime's: only the last version's tokens train
    assert [g.response_mask for g in out] == [[0, 0, 0, 1], None, [0, 1], None] and frac == 4 / 11
    assert mask_older(gens, older_than=-1) == (gens, 0.0)
    assert interrupted_share(gens) == 2 / 4


def test_the_default_chunk_ends_a_batch_within_the_versions_it_sees():
    assert chunk_tokens(RolloutConfig(max_new_tokens=7, staleness=2)) == 4
    assert chunk_tokens(RolloutConfig(max_new_tokens=7, staleness=2, partial_chunk_tokens=3)) == 3
