"""One Megatron model role (actor, critic or reference) on this rank's TP/PP/DP groups.

Every forward and backward goes through megatron's `get_forward_backward_func`, so pipeline
parallelism works with micro-batches; trainable roles are wrapped in megatron DDP with a megatron
optimizer (optionally the distributed optimizer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bridge.models import Recompute
from megatron_bridge.parallel import ParallelGroups
from megatron_bridge.patches import optimizer_state
from rlstack import collectives
from rlstack.workers.batch import MicroBatches, pack_micro_batches
from rlstack.workers.embedding_grad import EmbeddingGradIntoMainGrad
from rlstack.workers.packing import PREFIX_LENS, PREFIX_ROWS, SEQ_LENS, PackedRows, prompt_groups


@dataclass
class UpdateResult:
    """One optimizer step of a role on a mini-batch (`Actor.update`, `Critic.update`)."""

    stats: list[dict]  # loss statistics of each micro-batch (last pipeline stage; empty on the others)
    grad_norm: float  # the global gradient norm before clipping (0.0 with forward_only)


@dataclass
class OptimSettings:
    lr: float
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    # Shard the optimizer state (and the fp32 main params of bf16 weights) over DP: ZeRO-1, exact
    # (tests/distributed/test_megatron_parallel.py), 1/dp of the optimizer bytes per rank. On by
    # default; at DP 1 it holds what the plain optimizer holds (fp32 shards are views of the
    # weights), and staying on there keeps one checkpoint format when a run resumes at another DP
    # (megatron-core 0.16.1 cannot load a distributed-optimizer checkpoint into the plain optimizer:
    # KeyError 'pre_wd_mult' in `_filter_and_reorder_param_groups`).
    use_distributed_optimizer: bool = True
    optimizer: str = "adam"  # adam | sgd
    adam_eps: float = 1e-8
    # Learning-rate schedule, in trainer steps (LRSchedule.step() once per step, as verl steps its
    # scheduler once per training step): linear warm-up from 0, then constant or cosine to min_lr.
    lr_schedule: str = "constant"  # constant | cosine
    lr_warmup_steps: int = 0
    total_steps: int = 1  # the cosine reaches min_lr here
    min_lr_ratio: float = 0.0  # min_lr = min_lr_ratio x lr


def warmup_steps(steps: int, ratio: float, total_steps: int) -> int:
    """Warm-up length: `steps` when > 0, else int(ratio x total_steps) (verl's lr_warmup_steps_ratio)."""
    return int(steps) if steps > 0 else int(ratio * total_steps)


class LRSchedule:
    """megatron-core's OptimizerParamScheduler over one role's optimizer, counted in trainer steps.

    Step k (0-based) trains with lr(k): warm-up `lr * k / W` for k <= W, then `lr` (constant) or
    `min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (k - W) / (total - W)))` (cosine), min_lr after
    `total`. That is verl's schedule (zero-indexed LambdaLR with num_cycles 0.5) step for step.
    `state_dict()` / `load_state_dict()` carry the position; on load the schedule's shape comes
    from this run's config (a resumed run may change it), only the step count from the checkpoint.
    """

    def __init__(self, optimizer, settings: OptimSettings):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if settings.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr schedule {settings.lr_schedule!r} is unknown: use constant or cosine")
        warmup = max(0, int(settings.lr_warmup_steps))
        min_lr = settings.lr * settings.min_lr_ratio if settings.lr_schedule == "cosine" else settings.lr
        self.scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=settings.lr,
            min_lr=min_lr,
            lr_warmup_steps=warmup,
            # megatron asserts warmup < decay steps; a warm-up as long as the run never decays.
            lr_decay_steps=max(int(settings.total_steps), warmup + 1),
            lr_decay_style=settings.lr_schedule,
            start_wd=settings.weight_decay,
            end_wd=settings.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )

    @property
    def num_steps(self) -> int:
        return self.scheduler.num_steps

    @property
    def lr(self) -> float:
        """The lr the next optimizer step uses (of the default parameter group)."""
        return float(self.scheduler.optimizer.param_groups[0]["lr"])

    def step(self, increment: int = 1) -> float:
        """After a trainer step: move to the next step's lr; returns it."""
        self.scheduler.step(increment)
        return self.lr

    def state_dict(self) -> dict:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.num_steps = 0
        self.scheduler.step(int(state["num_steps"]))


class MegatronRole:
    """A (possibly DDP-wrapped) GPTModel stage plus its optimizer."""

    def __init__(
        self,
        hf_dir: str,
        groups: ParallelGroups,
        dtype: torch.dtype,
        value_head: bool = False,
        optim: Optional[OptimSettings] = None,
        recompute: Recompute = False,
        value_head_seed: int = 0,
        fused_output: bool = False,
        lora=None,
    ):
        from megatron_bridge.hf import build_megatron_from_hf

        self.groups = groups
        model, self.args = build_megatron_from_hf(
            hf_dir, groups, dtype=dtype, value_head=value_head, recompute=recompute, value_head_seed=value_head_seed
        )
        self.config = model.config
        # `lora` (a megatron_bridge.lora.LoraSpec, rank > 0): the base frozen and adapters added before
        # DDP and the optimizer are built, so both hold the adapters only.
        self.lora = lora if lora is not None and optim is not None else None
        if self.lora is not None:
            _add_lora(model, self.lora, groups, self.args, value_head)
        self.max_tokens_per_micro_batch = 0  # algorithm.max_tokens_per_micro_batch (0: micro_batch_size rows)
        # model.remove_padding: each micro-batch's rows run packed end to end (rlstack/workers/packing.py)
        self.remove_padding = False
        # model.prefix_sharing: with remove_padding, rows that share a prompt pack it once (packing.py);
        # only under the SDPA core attention (megatron_bridge/shared_prefix.py), set by `share_prefixes`
        self.prefix_sharing = False
        self.optimizer = None
        self.lr_schedule: Optional[LRSchedule] = None  # trained roles: step() once per trainer step
        if optim is None:
            model.requires_grad_(False)
            model.eval()
            self.model = model
        else:
            self.model, self.optimizer, self.lr_schedule = _wrap_for_training(model, self.config, optim)
        self.padded_vocab = self.args.padded_vocab_size(groups.dims.tp)
        # model.fused_output_logprobs: the last stage's LM head hands its input to the loss, which
        # multiplies it chunk by chunk (rlstack.workers.logprobs.fused_output_logprobs).
        self.fused_output = fused_output and not value_head
        self.value_head = value_head
        self._lm_head = _DeferredLMHead(self.module) if self.fused_output and groups.is_last_stage else None
        # training: the word embedding's gradient straight into its main_grad (embedding_grad.py)
        embedding = getattr(getattr(self.module, "embedding", None), "word_embeddings", None)
        self._embedding_grad = (
            EmbeddingGradIntoMainGrad(embedding) if embedding is not None and self.optimizer is not None else None
        )

    def share_prefixes(self, on: bool) -> bool:
        """model.prefix_sharing: on where this role's model attends with the SDPA core attention, the
        shared-prompt RoPE patch is applied (no Transformer Engine) and rows run packed (pp=1);
        returns whether it is."""
        from megatron_bridge import patches
        from megatron_bridge.sdpa_attention import SDPADotProductAttention

        layers = getattr(getattr(self.module, "decoder", None), "layers", None) or []
        sdpa = bool(layers) and all(
            isinstance(getattr(layer.self_attention, "core_attention", None), SDPADotProductAttention)
            for layer in layers
        )
        self.prefix_sharing = bool(
            on
            and sdpa
            and "shared_prefix_rope" in (patches.applied() or ())
            and not getattr(self.config, "apply_rope_fusion", False)
            and self.config.context_parallel_size == 1
            and self.groups.dims.pp == 1  # pipeline parallelism runs padded rows (micro_batches)
        )
        return self.prefix_sharing

    @property
    def module(self):
        """The bare GPTModel (unwrapped from DDP)."""
        return getattr(self.model, "module", self.model)

    def output_weight(self) -> torch.Tensor:
        """The LM head's weight on the last stage, [V/tp, h]: the tied embedding or `output_layer.weight`."""
        m = self.module
        return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight

    def output_main_grad(self) -> Optional[torch.Tensor]:
        """The LM head weight's fp32 gradient buffer (megatron DDP's `main_grad`), into which the fused
        log-prob adds the head's gradient directly: fp32 weights of a trained role, bf16 on CPU (there the fp32
        gradient lands unrounded, as megatron's fused weight-gradient accumulation does on GPUs; the
        bf16 [V, h] gradient and its fp32 zeros are not made). megatron runs
        the grad reduce after backward here (`overlap_grad_reduce=False`), so no bucket waits for the
        head's own backward hook; a tied embedding still gets its lookup's gradient through its hook."""
        w = self.output_weight()
        grad = getattr(w, "main_grad", None)
        if self.optimizer is None or grad is None or grad.dtype != torch.float32:
            return None
        if not (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and w.device.type == "cpu")):
            return None  # bf16 on GPUs keeps the head's bf16 gradient and DDP's hook (not run on a GPU yet)
        return grad if grad.shape == w.shape else None

    def run(self, micro_batches: list[dict], loss_fn: Callable, forward_only: bool) -> list[dict]:
        """Run `loss_fn(mb, output) -> (loss, stats)` over micro-batches; stats from the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if SEQ_LENS in mb:  # padding removed: the rows end to end, the output back in [b, S] rows
                packed = PackedRows.of(
                    mb[SEQ_LENS], mb["tokens"].shape[1], mb["tokens"].device, mb.get(PREFIX_ROWS), mb.get(PREFIX_LENS)
                )
                output = model(
                    packed.pack(mb["tokens"]), packed.pack(mb["position_ids"]), None, packed_seq_params=packed.params
                )
                output = packed.unpack(output)
            else:
                output = model(mb["tokens"], mb["position_ids"], None)
            return output, functools.partial(_call_loss, loss_fn, mb)

        tokens = micro_batches[0]["tokens"]
        deferred = self._lm_head if self._lm_head is not None else _nullcontext()
        direct = self._embedding_grad if self._embedding_grad is not None and not forward_only else _nullcontext()
        with torch.no_grad() if forward_only else _nullcontext(), deferred, direct:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[self.model],
                num_microbatches=len(micro_batches),
                seq_length=tokens.shape[1],
                micro_batch_size=tokens.shape[0],
                forward_only=forward_only,
            )

    def train_step(self, micro_batches: list[dict], loss_fn: Callable) -> tuple[list[dict], float]:
        """Zero grads, forward/backward every micro-batch, one optimizer step. Returns (stats, grad norm).

        A non-finite global gradient norm skips the step (no weight changes) and is returned as is:
        the caller decides whether the run stops (rlstack.workers.finite).
        """
        from rlstack.workers.finite import step_unless_nonfinite

        assert self.optimizer is not None, "reference roles are frozen"
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = self.run(micro_batches, loss_fn, forward_only=False)
        _, grad_norm = step_unless_nonfinite(self.optimizer)
        return stats, grad_norm

    def micro_batches(
        self, batch: dict[str, torch.Tensor], micro_batch_size: int, lengths: torch.Tensor
    ) -> MicroBatches:
        """`batch`'s micro-batches for this role: sorted by length and cut to their longest row
        without pipeline parallelism (of `micro_batch_size` rows, or filled up to
        `max_tokens_per_micro_batch` token slots), in order and uncut with it (one shape between stages).
        With `remove_padding` (no pipeline parallelism) each carries its rows' lengths (`SEQ_LENS`)
        and runs packed."""
        if self.groups.dims.pp > 1:
            return pack_micro_batches(batch, micro_batch_size, None)
        # Packed rows come back as [b, S, ...] (PackedRows.unpack): a copy of the output, small for a
        # value head or the fused LM head's hidden states, a second [b, S, V] logits tensor otherwise.
        packed = self.remove_padding and (self.fused_output or self.value_head)
        units = None
        if packed and self.prefix_sharing and "resp_mask" in batch:
            units = prompt_groups(batch["tokens"], batch["resp_mask"], batch["position_ids"], lengths)
            units = units if any(p for _, p in units) else None
        mbs = pack_micro_batches(
            batch, micro_batch_size, lengths, self.max_tokens_per_micro_batch, balance=packed, units=units
        )
        if packed:
            start, host_lengths = 0, lengths.cpu()  # [B]
            unit_of = {r: u for u, (rows, p) in enumerate(units or ()) if p for r in rows}
            for mb in mbs.batches:
                rows = mbs.order[start : start + mb["tokens"].shape[0]].tolist()
                mb[SEQ_LENS] = host_lengths[rows]  # [b]
                if units is not None:  # shared prompts: a unit's first row here holds its prompt for the others
                    lead, prefix_rows, prefix_lens = {}, [], []
                    for i, r in enumerate(rows):
                        u = unit_of.get(r)
                        j = lead.setdefault(u, i) if u is not None else i
                        prefix_rows.append(j if j != i else -1)
                        prefix_lens.append(units[u][1] if j != i else 0)
                    mb[PREFIX_ROWS], mb[PREFIX_LENS] = torch.tensor(prefix_rows), torch.tensor(prefix_lens)
                start += len(rows)
        return mbs

    def loss_scale(self, num_micro_batches: int) -> float:
        """What each micro-batch's loss is multiplied by so that the gradient is that of the globally
        normalised loss: megatron divides every micro-batch loss by their number (this rank's, which
        differs between DP ranks with token-budget micro-batches) and DDP averages over DP."""
        return float(num_micro_batches * self.groups.dims.dp)

    def broadcast_from_last_stage(self, tensor: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
        """Last pipeline stage's tensor on every stage of this pipeline."""
        g = self.groups
        if g.dims.pp == 1:
            return tensor
        tensor = torch.empty(shape, dtype=dtype, device=g.device) if tensor is None else tensor.contiguous()
        return collectives.broadcast_(tensor, collectives.src_of_last(g.pp), g.pp, g.device)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _DeferredLMHead:
    """Within `with`: the GPTModel's output layer returns its input, in the TP region, instead of logits.

    Only the multiplication moves to the loss (`fused_output_logprobs`). Entering the TP region is
    kept: forward the identity, backward the hidden states' gradient all-reduced over TP (what
    ColumnParallelLinear's `allreduce_dgrad` does). GPTModel returns the result as [b, s, h] (its
    `transpose(0, 1).contiguous()` of "logits"), so that gradient arrives transposed.
    rlstack's models run without sequence parallelism (megatron_bridge.models).
    """

    def __init__(self, model):
        self.layer = model.output_layer
        assert not self.layer.sequence_parallel, "bug: the fused LM head has no sequence-parallel gather"

    def forward(self, input_, weight=None, runtime_gather_output=None):
        return _EnterTensorParallel.apply(input_, self.layer.tp_group), None

    def __enter__(self):
        self.layer.forward = self.forward  # an instance attribute: nn.Module.__call__ finds it first
        return self

    def __exit__(self, *exc):
        del self.layer.forward  # the class's ColumnParallelLinear.forward again
        return False


class _EnterTensorParallel(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the TP group.

    Not megatron's `copy_to_tensor_model_parallel_region`: in megatron-core 0.16.1 its `_reduce`
    all-reduces `grad.contiguous()` and returns `grad`, so a non-contiguous gradient (here: a
    transposed one) comes back unreduced (docs/megatron_core.md).
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.group is not None and ctx.group.size() > 1:
            collectives.all_reduce_(grad, ctx.group, grad.device)
        return grad, None


def _call_loss(loss_fn, mb, output):
    loss, stats = loss_fn(mb, output)
    return loss, stats


def _distributed(optim: OptimSettings) -> bool:
    """megatron-core 0.16.1's DistributedOptimizer takes Adam only ("Only Adam and HybridDeviceOptimizer
    currently supported", distrib_optimizer.py): SGD (a test-only setting) keeps the plain optimizer."""
    return optim.use_distributed_optimizer and optim.optimizer == "adam"


def lora_spec(lora_cfg, seed: int = 0):
    """A `model.lora` / `critic.lora` config section -> megatron_bridge.lora.LoraSpec (MegatronRole's
    `lora`), or None when its rank is 0. `seed` (trainer.seed) seeds A's init."""
    from megatron_bridge.lora import LoraSpec, resolve_targets

    if lora_cfg.rank <= 0:
        return None
    return LoraSpec(
        rank=lora_cfg.rank,
        alpha=lora_cfg.alpha,
        dropout=lora_cfg.dropout,
        target_modules=resolve_targets(lora_cfg.target_modules),
        init=lora_cfg.init,
        seed=seed,
    )


def _add_lora(model, spec, groups: ParallelGroups, args, value_head: bool) -> None:
    from megatron_bridge.lora import add_lora_
    from megatron_bridge.mappings import layer_offset

    offset = layer_offset(args, groups.pp_rank, groups.dims.pp)
    # a critic's value head is new: it trains in full beside the adapters
    add_lora_(model, spec, groups.tp, offset, trainable=("output_layer",) if value_head else ())


def _wrap_for_training(model, config, optim: OptimSettings):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=_distributed(optim),
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    min_lr = optim.lr * optim.min_lr_ratio if optim.lr_schedule == "cosine" else optim.lr
    opt_config = OptimizerConfig(
        # lr / min_lr become each parameter group's max_lr / min_lr, which the scheduler reads.
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=_distributed(optim),
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    _fused_adam_on_cpu(optimizer)
    if next(model.parameters()).device.type == "cpu":
        # Adam's state now, not in the first step() (optimizer_state.allocate_adam_state: why). CPU only:
        # on a GPU the colocated engine's memory budget is set with the state lazily absent (unchanged).
        optimizer_state.allocate_adam_state(optimizer)
    schedule = LRSchedule(optimizer, optim)  # sets every group's lr for step 0
    return ddp, optimizer, schedule


def _fused_adam_on_cpu(optimizer) -> None:
    """torch's fused Adam kernel for the optimizer megatron builds without TE / apex, on CPU.

    megatron-core 0.16.1 (optimizer/__init__.py) falls back to `torch.optim.AdamW(params, lr, ...)`
    without `fused` or `foreach`: on CPU that is torch's per-tensor loop, ~10 kernels per parameter
    (SmolLM2's 67 M-parameter shard: 0.16-0.20 s a step, 0.04 s fused, AMD EPYC, 1 thread). The same
    update, rounded differently (~1 ulp). On a GPU TE's or apex's FusedAdam is megatron's choice.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):  # AdamW subclasses Adam
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if params and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False


def split_micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict]:
    """Split [B, ...] tensors into micro-batches of equal size (B must divide; callers pad)."""
    size = next(iter(batch.values())).shape[0]
    assert size % micro_batch_size == 0, f"batch {size} is not a multiple of micro batch {micro_batch_size}"
    return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, size, micro_batch_size)]


def cat_stats(stats: list[dict], key: str) -> Optional[torch.Tensor]:
    if not stats:
        return None
    return torch.cat([s[key] for s in stats], dim=0)
