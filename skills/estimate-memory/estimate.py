"""estimate-memory: memory per GPU of training a model under a parallel layout, from the model built on
the meta device (nothing is allocated): parameters, gradients, AdamW state, working copies of the
weights, and activations by a documented formula. PASS if the total fits --gib.

What the trainer holds (pith_train, pith_engine.parallel): fp32 master weights, fp32 gradients and two
fp32 AdamW moments, each sharded by FSDP2 (experts split over ep, then sharded over dp x cp; the other
weights sharded over dp x cp x ep), so each costs 4 bytes x (parameters / world) per GPU.

Working copies in the compute dtype (b bytes): on one GPU autocast keeps a b-byte copy of the weights
during forward and backward (b x all parameters; none for fp32); under FSDP a layer is all-gathered in
b bytes while the next is prefetched (2 x b x the largest layer, its experts the EP rank's share) and
its unsharded fp32 gradient waits for the reduce-scatter (4 x the largest layer); the root module
(embedding, lm_head) stays gathered after the forward (b x its parameters).

Activations saved for backward, one micro-batch of T = micro_batch x seq_len / cp tokens per GPU
(expert rows T x K: balanced routing gives every EP rank T x K rows on average), per layer:
    b x T x (sum over the layer's nn.Linear of in + out features  +  4 x D)     # matmul inputs/outputs,
                                                                                # norms and residuals
  + b x T x K x (sum over the layer's expert weights [E, in, out] of in + out)  # grouped-GEMM rows
  + 4 x T x E x 2                                                               # fp32 router logits, probs
plus b x T x D x 4 for the embedding output, final norm and the loss's dh, plus lm_head's weight
gradient, which the fused loss computes in the forward (V x D in the weight's dtype). Flash/SDPA
attention keeps no S x S matrix. Against the bytes the staged forward saves (measured with
saved_tensors_hooks on the tiny presets, skills/test_skills.py) it errs high by 10-60%: q, k and v
read one input, counted three times. Not counted: transient buffers (one chunk of logits in the
loss, a layer's backward working set), allocator fragmentation, CUDA context (~0.5 GiB).

Shape legend: T tokens per GPU, D hidden, K top-k, E experts, V vocabulary, b compute-dtype bytes.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # skills/, for _common
import _common  # noqa: E402
import pith_models  # noqa: E402
from pith_engine.parallel import Layout, check_layout, expert_param_names, num_experts  # noqa: E402
from torch import nn  # noqa: E402

BYTES = {"bf16": 2, "fp32": 4}  # --dtype: the compute dtype


def activation_bytes(model: nn.Module, tokens: float, b: int, weight_bytes: int) -> float:
    """The formula of the module docstring for `tokens` tokens on one GPU."""
    cfg = model.cfg
    D, V, K = cfg.hidden_size, cfg.vocab_size, cfg.num_experts_per_tok
    total = b * tokens * D * 4 + weight_bytes * V * D
    for layer in model.layers.values():
        linear = sum(m.in_features + m.out_features for m in layer.modules() if isinstance(m, nn.Linear))
        total += b * tokens * (linear + 4 * D)
        if layer.experts is not None:
            weights = [p for p in layer.experts.parameters() if p.ndim == 3]
            total += b * tokens * K * sum(p.shape[1] + p.shape[2] for p in weights)
            total += 4 * tokens * weights[0].shape[0] * 2
    return total


def estimate(model: nn.Module, layout: Layout, micro_batch: int, seq_len: int, b: int) -> dict[str, float]:
    """Bytes per GPU by item (see the module docstring); the model may be on the meta device."""
    world = layout.world
    experts = expert_param_names(model)
    params = dict(model.named_parameters())
    n_expert = sum(params[n].numel() for n in experts)
    n_dense = sum(p.numel() for n, p in params.items() if n not in experts)
    shard = n_dense / world + n_expert / (layout.ep * layout.dp * layout.cp)

    def layer_numel(layer: nn.Module) -> float:
        held = {id(p) for p in layer.experts.parameters()} if layer.experts is not None else set()
        return sum(p.numel() / (layout.ep if id(p) in held else 1) for p in layer.parameters())

    if world == 1:
        copies = b * (n_dense + n_expert) if b < 4 else 0.0
    else:
        in_layers = {id(p) for p in model.layers.parameters()}
        root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
        biggest = max(layer_numel(layer) for layer in model.layers.values())
        copies = (2 * b + 4) * biggest + b * root
    tokens = micro_batch * seq_len / layout.cp
    return {
        "parameters (fp32, sharded)": 4 * shard,
        "gradients (fp32, sharded)": 4 * shard,
        "AdamW moments (2 x fp32, sharded)": 8 * shard,
        "weight copies in the compute dtype": copies,
        f"activations ({tokens:g} tokens/GPU, formula)": activation_bytes(
            model, tokens, b, 4 if world == 1 else b
        ),
    }


def main(argv: list[str] | None) -> tuple[bool, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_model_args(parser, batch=(1, 4096))
    parser.add_argument("--dtype", default="bf16", choices=sorted(BYTES), help="compute dtype")
    for axis in ("dp", "ep", "cp"):
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} ranks")
    parser.add_argument("--gib", type=float, required=True, help="memory budget per GPU, GiB")
    args = parser.parse_args(argv)
    cfg = _common.model_cfg(args)
    model = pith_models.build(cfg)  # meta device
    layout = Layout(dp=args.dp, cp=args.cp, ep=args.ep)
    check_layout(
        layout, world_size=layout.world, num_experts=num_experts(model), seq_len=args.seq_len,
        global_batch=args.micro_batch * layout.data_ranks, micro_batch=args.micro_batch,
    )  # fmt: skip
    items = estimate(model, layout, args.micro_batch, args.seq_len, BYTES[args.dtype])
    total = sum(items.values())
    print(
        f"{args.model}: {pith_models.param_count(model):,} parameters; dp={args.dp} ep={args.ep} cp={args.cp}"
        f" ({layout.world} GPUs), micro-batch {args.micro_batch} x {args.seq_len} tokens, {args.dtype}"
    )
    for what, nbytes in [*items.items(), ("total per GPU", total)]:
        print(f"  {what:<44} {nbytes / _common.GIB:10.3f} GiB")
    fits = total <= args.gib * _common.GIB
    return fits, f"{total / _common.GIB:.3f} GiB per GPU {'<=' if fits else '>'} budget {args.gib:g} GiB"


if __name__ == "__main__":
    _common.verdict(main)
