"""Expert parallelism: a small Mixtral under ``sf.expert_parallel`` against the same model
without it, the MoE layer against DeepSpeed-MoE's, and the all-to-all bytes against the formula.

Issue #28 asks for shardfn's expert parallelism against torchtitan's or DeepSpeed's where
either runs on CPU gloo, else against the same model without ep on one process. Two tables:

1. **The model** (the issue's fallback peer): the Hugging Face ``MixtralForCausalLM`` from
   a small config (hidden 64, 2 layers, 8 experts, top-2, vocabulary 256) through
   ``sf.functional``, (a) each rank alone on its own batch, no communication, and (b)
   under ``sf.expert_parallel`` over all ranks (``E/N`` experts each; every rank routes its
   own batch, rows travel to the experts' ranks and back). A step is ``torch.func.grad``
   of Hugging Face's loss (cross-entropy + 0.02 x the aux loss) and an SGD update. Before
   timing, the ep gradients (gathered) are checked against the one-process gradient of
   the mean of every rank's loss ("max rel diff").
2. **The layer**: shardfn's ``MoE`` (dropless top-2, SwiGLU experts) without ep, under
   ``sf.expert_parallel``, and DeepSpeed-MoE's ``MoE(ep_size=N, drop_tokens=False)`` with
   the same weights and tokens (when ``deepspeed`` is installed: with
   ``DS_ACCELERATOR=cpu`` it runs on CPU gloo), an autograd step each; "max rel diff"
   compares each output with shardfn's unsplit layer's. torchtitan is not run (not
   installed; see the printed note).

Systems alternate in rotating rounds with a barrier around each step (rank 0's clock);
a ratio is the median of the per-round ratios of step times (same tokens per rank).

The bytes each rank sends per step (``sf.comm_stats``) are compared with the formula of
``shardfn.models.moe_dispatch``, from the routing of that step: per layer the counts
``8 E (ep-1)/ep``; the rows ``2 (R + R') H b`` (``R`` the assignments this rank sends to
experts on other ranks, ``R'`` those it receives; forward and backward); and the psum of
the replicated leaves' gradients over the axis, ``2 (ep-1)/ep`` times their bytes.

Run (about a minute on 2 busy cores):
    .venv/bin/python benchmarks/bench_moe.py
    .venv/bin/python benchmarks/bench_moe.py --quick     # a smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from _common import BenchOutput, round_order

SYSTEMS = (("one", "one process (no ep), each rank alone"),
           ("ep", "sf.expert_parallel"))
LR = 1e-3


def config(quick: bool):
    """The Mixtral config (random init); ``quick``: half the width."""
    from transformers import MixtralConfig

    hidden = 32 if quick else 64
    return MixtralConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                         router_aux_loss_coef=0.02, output_router_logits=True,
                         tie_word_embeddings=False)


def batch(rank: int, args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, 256, (args.batch, args.seq),
                         generator=torch.Generator().manual_seed(1000 + rank))


def _loss(model, leaves, ids):
    return model.apply(leaves, input_ids=ids, labels=ids, output_router_logits=True).loss


def _step_fn(model, rest, ids):
    """One SGD step of ``model`` on ``ids``: ``trainable -> trainable``."""
    def step(trainable):
        grads = torch.func.grad(lambda t: _loss(model, model.merge(t, rest), ids))(trainable)
        return {k: v - LR * grads[k] for k, v in trainable.items()}
    return step


def _routing_counts(model, leaves, ids, experts: int, ep: int) -> list[list[int]]:
    """Per layer: the assignments of this rank's tokens to the experts of each rank."""
    with torch.no_grad():
        logits = model.apply(leaves, input_ids=ids, output_router_logits=True).router_logits
    per_layer = []
    for layer in logits:
        chosen = torch.topk(torch.softmax(layer.float(), -1), 2, dim=-1).indices
        per_expert = torch.bincount(chosen.reshape(-1), minlength=experts)
        per_layer.append(per_expert.view(ep, experts // ep).sum(1).tolist())
    return per_layer


def rank_main(args: argparse.Namespace) -> dict:
    from transformers import MixtralForCausalLM

    import shardfn as sf
    from shardfn.transforms.experts import expert_parallel

    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = config(args.quick)
    torch.manual_seed(0)
    hf = MixtralForCausalLM(cfg)
    fm = sf.functional(hf)
    full = fm.params_from(hf)
    mesh = sf.Mesh({"ep": n})
    ep = expert_parallel(fm, mesh, "ep")
    ids = batch(rank, args)

    # correctness first: the ep gradient (gathered) against the mean of all ranks' losses
    one_trainable, one_rest = fm.split_trainable(full)
    reference = torch.func.grad(lambda t: sum(
        _loss(fm, fm.merge(t, one_rest), batch(r, args)) for r in range(n)) / n)(one_trainable)
    ep_trainable, ep_rest = ep.split_trainable(ep.params_from(hf))
    sf.reset_comm_stats()
    local_grads = torch.func.grad(lambda t: _loss(ep, ep.merge(t, ep_rest), ids))(ep_trainable)
    sent = dict(sf.comm_stats().by_op)  # one step's traffic (the gather below is not the step's)
    grads = ep.gather(local_grads)
    rel = max(((grads[k] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
              for k, ref in reference.items())
    routing = _routing_counts(ep, ep.merge(ep_trainable, ep_rest), ids,
                              cfg.num_local_experts, n)

    steps = {"one": _step_fn(fm, one_rest, ids), "ep": _step_fn(ep, ep_rest, ids)}
    state = {"one": one_trainable, "ep": ep_trainable}
    times: dict[str, list[float]] = {k: [] for k in steps}
    keys = [k for k, _ in SYSTEMS]
    for r in range(args.warmup + args.rounds):
        for key in round_order(keys, r):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state[key] = steps[key](state[key])
            dist.barrier()
            if r >= args.warmup:
                times[key].append((time.perf_counter() - t0) / args.steps)
    expert_bytes = {key: sum(v.numel() * v.element_size() for k, v in tree.items()
                             if k in ep.experts) for key, tree in state.items()}
    replicated = sum(v.numel() * v.element_size() for k, v in ep_trainable.items()
                     if k not in ep.experts)
    return {"times": times, "sent": {f"{a}/{op}": b for (a, op), b in sent.items()},
            "routing": routing, "rel": rel, "expert_bytes": expert_bytes,
            "replicated_bytes": replicated, "rank": rank}


class SwiGLU(torch.nn.Module):
    """DeepSpeed's expert module: the SwiGLU of one shardfn expert (no bias)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def _deepspeed_layer(full: dict, hidden: int, inner: int, experts: int, ep: int):
    """DeepSpeed's MoE layer (dropless top-2, no 2nd-expert sampling) holding the same
    weights as ``full``, or the reason it cannot be built here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
    except ImportError as error:
        return f"not installed ({error})"
    deepspeed.init_distributed(dist_backend="gloo")
    layer = DeepSpeedMoE(hidden, SwiGLU(hidden, inner), num_experts=experts, ep_size=ep, k=2,
                         drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    layer.set_deepspeed_parallelism()  # its ep group (deepspeed.initialize would do it)
    local, first = experts // ep, dist.get_rank() % ep * (experts // ep)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(full["gate.weight"])
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts[:local]):
            expert.gate_up.weight.copy_(full["experts.gate_up_proj"][first + i])
            expert.down.weight.copy_(full["experts.down_proj"][first + i])
    return layer


def layer_main(args: argparse.Namespace) -> dict:
    """The MoE layer alone: shardfn's ``MoE`` with and without ep against DeepSpeed-MoE
    (autograd steps, the same weights and tokens); per-round step times and the largest
    relative difference of each output from shardfn's."""
    import shardfn as sf
    from shardfn.models.moe import MoE
    from shardfn.transforms.experts import expert_parallel

    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    hidden, inner, experts = (32, 64, 8) if args.quick else (64, 128, 8)
    tokens = args.batch * args.seq
    torch.manual_seed(0)
    fm = sf.functional(MoE(hidden, inner, experts, top_k=2))
    full = fm.init(0)
    model = expert_parallel(fm, sf.Mesh({"ep": n}), "ep")
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7 + rank))

    def functional_step(fmodel, leaves):
        def step():
            live = {k: v.clone().requires_grad_() for k, v in leaves.items()}
            out, aux = fmodel.apply(live, x)
            (out.square().mean() + aux.loss).backward()
            return out.detach()
        return step

    steps = {"layer_one": functional_step(fm, full), "layer_ep": functional_step(model,
                                                                                model.shard(full))}
    ds = _deepspeed_layer(full, hidden, inner, experts, n)
    if not isinstance(ds, str):
        def ds_step():
            ds.zero_grad(set_to_none=True)
            out, l_aux, _ = ds(x)
            (out.square().mean() + 0.01 * l_aux).backward()
            router = ds.deepspeed_moe.gate.wg.weight.grad  # its engine's data-parallel mean,
            dist.all_reduce(router)                        # as shardfn's psum of the router
            router.div_(n)
            return out.detach()
        steps["layer_ds"] = ds_step
    reference = steps["layer_one"]()
    rel = {k: ((fn() - reference).abs().max() / reference.abs().max()).item()
           for k, fn in steps.items()}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(args.warmup + args.rounds):
        for key in round_order(list(steps), r):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[key]()
            dist.barrier()
            if r >= args.warmup:
                times[key].append((time.perf_counter() - t0) / args.steps)
    return {"times": times, "rel": rel, "deepspeed": ds if isinstance(ds, str) else "ran",
            "shape": (tokens, hidden, inner, experts)}


def formula(outs: list[dict], rank: int, experts: int, hidden: int) -> dict[str, int]:
    """Bytes rank ``rank`` sends per step by the formula, from every rank's routing."""
    n = len(outs)
    rows = 0
    for layer in range(len(outs[rank]["routing"])):
        to_others = sum(c for dst, c in enumerate(outs[rank]["routing"][layer]) if dst != rank)
        from_others = sum(o["routing"][layer][rank] for src, o in enumerate(outs) if src != rank)
        rows += 2 * (to_others + from_others)
    layers = len(outs[rank]["routing"])
    return {"ep/all_to_all": layers * 8 * experts * (n - 1) // n,
            "ep/all_to_all_v": rows * hidden * 4,
            "ep/psum": 2 * (n - 1) * outs[rank]["replicated_bytes"] // n}


def _cell(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{fmt.format(q[1] * scale)} ({fmt.format(q[0] * scale)}–{fmt.format(q[2] * scale)})"


def layer_table(layers: list[dict], args: argparse.Namespace) -> str:
    """The layer systems' step times (rank 0) and output differences (largest over ranks)."""
    times = layers[0]["times"]
    tokens, hidden, inner, experts = layers[0]["shape"]
    labels = {"layer_one": "shardfn MoE layer, no ep, each rank alone",
              "layer_ep": f"shardfn MoE layer, sf.expert_parallel ep={args.ranks}",
              "layer_ds": f"DeepSpeed-MoE layer, ep_size={args.ranks}"}
    lines = [f"| system | step ms ({tokens} tokens, H={hidden}, I={inner}, E={experts}) "
             "| ratio to one process | max rel diff (output) |", "|---|---:|---:|---:|"]
    for key in times:
        ratios = [a / b for a, b in zip(times[key], times["layer_one"], strict=True)]
        ratio = _cell(ratios, fmt="{:.2f}") if key != "layer_one" else "—"
        rel = f"{max(out['rel'][key] for out in layers):.1e}" if key != "layer_one" else "—"
        lines.append(f"| {labels[key]} | {_cell(times[key], 1e3)} | {ratio} | {rel} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks, the ep size (divides 8)")
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    parser.add_argument("--steps", type=int, default=3, help="steps per system and round")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--quick", action="store_true", help="half width, 3 rounds of 1 step")
    parser.add_argument("--results", default=None,
                        help="also write the tables as JSON here (benchmarks/report.py)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.batch, args.seq = 3, 1, 2, 32
    if 8 % args.ranks:
        raise SystemExit(f"--ranks {args.ranks} must divide the 8 experts")
    import bench_moe  # the ranks unpickle bench_moe.rank_main by reference, not __main__'s copy

    from shardfn.testing import local_world

    start = time.perf_counter()
    with local_world(args.ranks, timeout=600.0, check=False) as world:
        outs = world.run(bench_moe.rank_main, args)
        layers = world.run(bench_moe.layer_main, args)
    cfg = config(args.quick)
    report = BenchOutput("moe")
    print(f"$ {report.command}")
    tokens = args.batch * args.seq
    report.setup(f"{args.ranks} ranks (gloo, 1 thread each); Hugging Face MixtralForCausalLM "
                 f"from config: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
                 f"{cfg.num_local_experts} experts, top-2, vocabulary 256; {args.batch} x "
                 f"{args.seq} = {tokens} tokens per rank; torch.func.grad + SGD; "
                 f"{args.rounds} rounds after {args.warmup} warm-up, {args.steps} steps of each "
                 f"system per round, rotating order, barrier to barrier (rank 0's clock); "
                 f"{time.perf_counter() - start:.0f} s in all.")
    times = outs[0]["times"]
    ratios = [e / o for e, o in zip(times["ep"], times["one"], strict=True)]
    rel = max(o["rel"] for o in outs)
    lines = ["| system | step ms: median (p25–p75) | µs per token | ratio to one process "
             "| max rel diff (grads) |", "|---|---:|---:|---:|---:|"]
    for key, label in SYSTEMS:
        name = f"{label}, ep={args.ranks}" if key == "ep" else label
        per_token = statistics.median(times[key]) / tokens * 1e6
        ratio = _cell(ratios, fmt="{:.2f}") if key == "ep" else "—"
        diff = f"{rel:.1e}" if key == "ep" else "—"
        lines.append(f"| {name} | {_cell(times[key], 1e3)} | {per_token:.1f} | {ratio} "
                     f"| {diff} |")
    report.table("\n".join(lines),
                 "Step time per rank, the same tokens per rank: the time-per-token ratio "
                 "of expert parallelism to the unsplit model (median and p25–p75 of the "
                 "per-round ratios).",
                 ratio="ratio to one process", peer="the same model without ep, one process",
                 quantity="step time")
    lines = ["| rank | collective | formula bytes | measured bytes | measured / formula |",
             "|---|---|---:|---:|---:|"]
    for rank in range(args.ranks):
        want = formula(outs, rank, cfg.num_local_experts, cfg.hidden_size)
        got = outs[rank]["sent"]
        for op in sorted(set(want) | set(got)):
            w, g = want.get(op, 0), got.get(op, 0)
            lines.append(f"| {rank} | {op} | {w:,} | {g:,} | "
                         f"{g / w:.3f} |" if w else f"| {rank} | {op} | 0 | {g:,} | — |")
    report.table("\n".join(lines),
                 "Bytes each rank sent in one step (sf.comm_stats) against the formula from "
                 "that step's routing (shardfn.models.moe_dispatch).")
    one, split = outs[0]["expert_bytes"]["one"], outs[0]["expert_bytes"]["ep"]
    report.note(f"Expert parameters per rank: {split:,} bytes under ep={args.ranks} against "
                f"{one:,} unsplit ({split / one:.3f} = 1/{one // split}).")
    report.table(layer_table(layers, args),
                 "The MoE layer alone (dropless top-2, SwiGLU experts, the same weights and "
                 "tokens on every system), an autograd step (forward and backward) per rank: "
                 "shardfn's MoE under expert_parallel and DeepSpeed-MoE's expert parallel "
                 "(ep_size = ranks; its router's gradient averaged over the ranks, as its "
                 "engine would and as shardfn's psum does), both against shardfn's MoE "
                 "without ep on each rank alone (median and p25–p75 of the per-round ratios).",
                 ratio="ratio to one process", peer="shardfn's MoE layer without ep",
                 quantity="step time")
    status = layers[0]["deepspeed"]
    report.note("DeepSpeed-MoE runs on CPU gloo (DS_ACCELERATOR=cpu; its gating is dense: "
                "one-hot [tokens, E, capacity] dispatch and combine tensors)." if status == "ran"
                else f"DeepSpeed-MoE row left out: deepspeed {status}; `pip install deepspeed` "
                "(with DS_ACCELERATOR=cpu it runs on CPU gloo).")
    report.note("torchtitan's expert parallel is not run: it is not installed here, and "
                "whether its ExpertParallel plan (DTensor over a DeviceMesh) runs on CPU gloo "
                "was not tried.")
    report.save(args.results)


if __name__ == "__main__":
    main()
