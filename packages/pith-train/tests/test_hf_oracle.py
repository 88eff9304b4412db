"""Pith's whole training step against an oracle Pith did not write: for a tiny Qwen3-MoE, DeepSeek-V2
(q-LoRA, group-limited routing, YaRN, shared experts) and GPT-OSS (sliding window, sinks, biases,
YaRN), each made by `transformers` with random weights and saved with save_pretrained, `pretrain`
(loading that directory) and the transformers model trained by torch.optim.AdamW on the same windows
(fp32, CPU) give the same per-step losses to a relative 1e-5, the same gradient norms, and the same
validation loss after the last update, and the same aux losses per step; with 1 and 4 micro-batches,
without clipping and with a max_norm below every step's gradient norm. The expert-bias update is off
(the transformers models route without a bias).

What the oracle is: the transformers model's forward and autograd backward; the loss written here
from its logits (summed token cross-entropy over the step's label tokens); gradient accumulation by
autograd over the micro-batches; torch.nn.utils.clip_grad_norm_; torch.optim.AdamW with weight decay
on the parameters this file names as matrices; the warmup + cosine schedule written out here. Only
the data windows come from Pith (pith_train.data.WindowLoader, so both sides see the same sequences).
So this pins the forward, the backward, the loss normalisation (every window's labels all count, so
not how a batch with ignored labels is weighed), accumulation, clipping, the optimizer with its
weight-decay groups and the learning-rate schedule.

The aux losses, from the transformers routers' logits (output_router_logits), each micro-batch's
term divided by the micro-batch count (their mean over the step), averaged over the MoE layers:
- load balancing from transformers' own `load_balancing_loss_func` for Qwen3-MoE and GPT-OSS (one
  function in both): it counts top-k choices per token, not per (token, k) entry, so it is K times
  Pith's E * sum_e f_e * P_e; and given several layers it pools them (the product of the layers'
  means), so it is called per layer. Both families select the top-k of the softmax (GPT-OSS: of the
  logits, the same order), as Pith does. DeepSeek-V2 has no such function in transformers and
  selects group-limited, so it trains without load balancing here.
- z-loss (no family's transformers model has one) written here: the mean of logsumexp(logits)^2.
With 4 micro-batches these see an aux loss, or its gradient, not divided by the micro-batch count.

optim.eps is 1e-3, as in test_equivalence.py: with the default 1e-8, Adam's first update moves every
weight by about lr whatever its gradient's size, so one whose gradient is at fp32's noise floor
(DeepSeek-V2's kv_a_proj_with_mqa had one at -1e-7) lands on a different value on each side, and the
losses drifted apart to 2.2e-6 in 4 steps. Weight decay 1.0 makes a parameter put in the wrong group
show: decaying GPT-OSS's expert biases moves the losses by 1.5e-5 at step 2, 1.3e-3 at step 4.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from pith_train.config import load_config
from pith_train.data import PackedDataset, WindowLoader
from pith_train.train import pretrain
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.qwen3_moe import modeling_qwen3_moe

STEPS, GLOBAL_BATCH, SEQ, VAL_WINDOWS = 4, 8, 32, 4
LR, WARMUP, MIN_LR_RATIO, WEIGHT_DECAY, BETAS, EPS = 1e-2, 2, 0.1, 1.0, (0.9, 0.95), 1e-3
RTOL = 1e-5  # measured: losses within 2.3e-7, validation losses within 2.8e-7
# Gradient norms: at the same weights both sides' gradients are within ~2e-6 of float64 ones
# (measured), but the gradient norms are more sensitive than the losses to the weights' fp32 noise:
# they drifted apart by up to 3.1e-6 here, 1.1e-5 with weight decay 0.1.
NORM_RTOL = 1e-4
# Below every step's gradient norm (2.2 to 6.3; asserted), so clipping scales every update: the
# losses of steps 2 to 4 then differ from unclipped training's by 1% to 5%.
CLIP = 1.0
# Aux losses of a size whose gradients move the losses: 0.1 * ~1.0 (load balancing), 1e-2 * ~4 (z).
LBL_COEF, Z_LOSS_COEF = 0.1, 1e-2

# transformers' configs of the three families: 2 layers, byte vocabulary (257 ids) padded to 260.
COMMON = dict(vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, tie_word_embeddings=False, attn_implementation="eager",
              experts_implementation="eager")  # fmt: skip
CONFIGS = {
    "qwen3_moe": transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    ),
    "deepseek_v2": transformers.DeepseekV2Config(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, q_lora_rank=24, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=3, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, routed_scaling_factor=1.5, num_key_value_heads=4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.9, "mscale_all_dim": 0.7, "truncate": True},
    ),
    "gpt_oss": transformers.GptOssConfig(
        **COMMON, intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False},
    ),
}  # fmt: skip
# Weight decay: Pith decays matrices, not vectors (norm scales, biases, sinks); a stacked expert
# tensor [E, ...] is E tensors of its per-expert shape, so GPT-OSS's stacked expert biases are vectors.
STACKED_EXPERT_BIASES = ("experts.gate_up_proj_bias", "experts.down_proj_bias")


def decays(name: str, p: torch.Tensor) -> bool:
    return p.ndim >= 2 and not name.endswith(STACKED_EXPERT_BIASES)


def lr_at(step: int) -> float:
    """Linear warmup over WARMUP steps to LR, then cosine decay to MIN_LR_RATIO * LR at the last step."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    low, progress = LR * MIN_LR_RATIO, (step - WARMUP) / (STEPS - 1 - WARMUP)
    return low + (LR - low) * 0.5 * (1 + math.cos(math.pi * progress))


def random_model(family: str) -> transformers.PreTrainedModel:
    """The family's transformers model, every parameter random (norm scales around 1; biases and sinks
    nonzero, so their gradients count); weights of 0.2 so that routing is far from ties."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family], dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def family_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    random_model(request.param).save_pretrained(path)
    return request.param, path


def aux_loss(router_logits: tuple, family: str, micro_batches: int) -> torch.Tensor:
    """One micro-batch's share of the step's aux losses (module docstring)."""
    cfg, lbl = CONFIGS[family], 0.0
    E, K = router_logits[0].shape[-1], cfg.num_experts_per_tok
    if family != "deepseek_v2":
        hf = {"qwen3_moe": modeling_qwen3_moe, "gpt_oss": modeling_gpt_oss}[family].load_balancing_loss_func
        lbl = sum(hf((x,), E, K) / K for x in router_logits)
    z = sum(torch.logsumexp(x.float(), -1).pow(2).mean() for x in router_logits)
    return (LBL_COEF * lbl + Z_LOSS_COEF * z) / len(router_logits) / micro_batches


def train_transformers(model, loader: WindowLoader, micro_batch: int, clip: float, family: str):
    """STEPS steps of the oracle -> (loss, gradient norm and aux loss per step, validation loss after)."""
    groups = [
        {"params": [p for n, p in model.named_parameters() if decays(n, p)], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in model.named_parameters() if not decays(n, p)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    model.train()
    losses, norms, auxes = [], [], []
    for step in range(STEPS):
        micro = loader.step_batch(step * GLOBAL_BATCH, GLOBAL_BATCH, micro_batch)
        label_tokens = sum((labels_BS != -100).sum() for _, labels_BS in micro)
        loss = aux = 0.0
        for inputs_BS, labels_BS in micro:
            out = model(input_ids=inputs_BS, output_router_logits=True)
            ce = (
                F.cross_entropy(out.logits.flatten(0, 1), labels_BS.flatten(), reduction="sum") / label_tokens
            )
            share = aux_loss(out.router_logits, family, len(micro))
            (ce + share).backward()
            loss, aux = loss + ce.item(), aux + share.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
        norms.append(norm.item())
        auxes.append(aux)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs_BS, labels_BS in loader.val_batches(micro_batch):
            logits_BSV = model(input_ids=inputs_BS).logits
            total += F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), reduction="sum").item()
            count += (labels_BS != -100).sum().item()
    return losses, norms, auxes, total / count


def pretrain_and_oracle(family_dir, data, micro_batch: int, clip: float, tmp_path):
    """Both sides' STEPS steps on `data` -> (pretrain's metrics rows and result, the oracle's losses,
    gradient norms and validation loss)."""
    family, hf_dir = family_dir
    overrides = [
        f"model.name={hf_dir}", f"data.path={data}", f"data.seq_len={SEQ}",
        f"data.val_windows={VAL_WINDOWS}", "train.device=cpu", f"train.steps={STEPS}",
        f"train.global_batch={GLOBAL_BATCH}", f"train.micro_batch={micro_batch}", f"train.lr={LR}",
        f"train.lbl_coef={LBL_COEF * (family != 'deepseek_v2')}", f"train.z_loss_coef={Z_LOSS_COEF}",
        "train.bias_rate=0", "optim.schedule=cosine",
        f"optim.warmup_steps={WARMUP}", f"optim.min_lr_ratio={MIN_LR_RATIO}",
        f"optim.weight_decay={WEIGHT_DECAY}", f"optim.beta1={BETAS[0]}", f"optim.beta2={BETAS[1]}",
        f"optim.eps={EPS}", f"optim.grad_clip={clip}", "checkpoint.every=0", "log.progress=false",
        "log.eval_every=0", "log.tensorboard=false",
    ]  # fmt: skip
    overrides.append(f"data.tokenizer={PackedDataset(str(data)).meta['tokenizer']}")  # byte or chat's
    cfg = load_config(None, overrides)
    out = pretrain(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    loader = WindowLoader(PackedDataset(str(data)), SEQ, VAL_WINDOWS, cfg.train.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    torch.testing.assert_close([r["lr"] for r in rows], [lr_at(s) for s in range(STEPS)], rtol=1e-12, atol=0)
    return rows, out, *train_transformers(model, loader, micro_batch, clip, family)


@pytest.mark.parametrize("micro_batch", [GLOBAL_BATCH, 2], ids=["1_micro_batch", "4_micro_batches"])
@pytest.mark.parametrize("clip", [0.0, CLIP], ids=["no_clip", "clip"])
def test_pretrain_steps_match_transformers_and_torch_adamw(
    family_dir, byte_data, micro_batch, clip, tmp_path
):
    rows, out, losses, norms, auxes, val_loss = pretrain_and_oracle(
        family_dir, byte_data, micro_batch, clip, tmp_path
    )
    if clip:
        assert min(norms) > clip, "the clipping setting must bind at every step"
    torch.testing.assert_close([r["loss"] for r in rows], losses, rtol=RTOL, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], norms, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close([r["aux"] for r in rows], auxes, rtol=RTOL, atol=0)
    assert out["val_loss"] == pytest.approx(val_loss, rel=RTOL)


@pytest.mark.parametrize("micro_batch", [GLOBAL_BATCH, 2], ids=["1_micro_batch", "4_micro_batches"])
def test_sft_steps_on_masked_conversations_match_transformers(family_dir, chat_data, micro_batch, tmp_path):
    """Fine-tuning: conversations (prepare-data --chat) whose labels are -100 outside the assistant's
    tokens, which are ~30% of a window's and fewer or more in each micro-batch: both sides divide the
    step's summed loss by the global batch's counted labels, so 1 and 4 micro-batches agree too."""
    rows, out, losses, norms, auxes, val_loss = pretrain_and_oracle(
        family_dir, chat_data, micro_batch, 0.0, tmp_path
    )
    torch.testing.assert_close([r["loss"] for r in rows], losses, rtol=RTOL, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], norms, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close([r["aux"] for r in rows], auxes, rtol=RTOL, atol=0)
    assert out["val_loss"] == pytest.approx(val_loss, rel=RTOL)
