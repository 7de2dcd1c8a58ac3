"""The training recipe: the learning-rate schedule, AdamW's weight decay (none on norms and
biases) and clipping by the global gradient norm, exact across TP, pipeline stages, unlike
replicas, vendors and a sharded optimizer, against a single-process reference built from torch's
own AdamW (two parameter groups) and torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from test_engine import CLUSTER, batches, stage

from hethub.runtime.flat_layout import FlatLayout
from hethub.runtime.grad_norm import counted_spans
from hethub.runtime.lr_schedule import lr_at
from hethub.runtime.model import Stage, shard
from hethub.runtime.optimizer import PlainAdamW
from hethub.runtime.precision import MasterWeights
from hethub.spec import load_model, parse_plan
from hethub.spec.buckets import rank_buckets
from hethub.spec.parameters import parameter_table, stage_parameters
from hethub.spec.topology import build_topology

SEED, LR, WEIGHT_DECAY, WARMUP, STEPS = 7, 1e-2, 0.1, 1, 3


def recipe(**fields) -> SimpleNamespace:
    base = {
        "lr": 1.0,
        "steps": 11,
        "lr_schedule": "cosine",
        "warmup_steps": 2,
        "min_lr": 0.1,
    }
    return SimpleNamespace(**{**base, **fields})


def test_the_rate_warms_up_linearly_then_decays_to_the_floor_at_the_last_step():
    cosine = recipe()
    assert [lr_at(s, cosine) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_at(10, cosine) == pytest.approx(0.1)  # the last step takes the floor
    assert lr_at(6, cosine) == pytest.approx(0.55)  # half way: the middle of the cosine
    assert lr_at(3, cosine) > lr_at(3, recipe(lr_schedule="linear"))  # the cosine starts slow
    linear = recipe(lr_schedule="linear")
    assert [lr_at(s, linear) for s in (2, 6, 10)] == pytest.approx([1.0, 0.55, 0.1])
    rates = [lr_at(s, cosine) for s in range(2, 11)]
    assert rates == sorted(rates, reverse=True)
    constant = recipe(lr_schedule="constant")
    assert [lr_at(s, constant) for s in range(11)] == [0.5] + [1.0] * 10


def test_the_defaults_are_five_percent_warm_up_and_a_tenth_of_the_rate():
    run = recipe(steps=100, warmup_steps=None, min_lr=None, lr=3e-3)
    assert lr_at(4, run) == pytest.approx(3e-3) and lr_at(3, run) == pytest.approx(0.8 * 3e-3)
    assert lr_at(99, run) == pytest.approx(3e-4)
    # a run of one step, or one all warm-up, still has a rate for every step
    assert lr_at(0, recipe(steps=1, warmup_steps=0)) == pytest.approx(1.0)
    assert lr_at(0, recipe(steps=2, warmup_steps=5)) == pytest.approx(0.2)


def decays(name: str, full_shape: tuple[int, ...]) -> bool:
    """The reference's rule, written apart from the runtime's: Megatron-LM's and torchtitan's."""
    return not name.endswith(".bias") and len(full_shape) != 1


def reference_adamw(named, table, lr) -> torch.optim.AdamW:
    """torch's AdamW over whole parameters in two groups: decayed, and norms and biases."""
    groups = [
        {"params": [p for n, p in named if decays(n, table[n].shape)], "weight_decay": 0.1},
        {"params": [p for n, p in named if not decays(n, table[n].shape)], "weight_decay": 0.0},
    ]
    assert groups[0]["params"] and groups[1]["params"]
    return torch.optim.AdamW(groups, lr=lr, foreach=True)


def train_flat(spec, weight_decay):
    """PlainAdamW over a whole model's flat buffer, a new rate every step: its weights."""
    model = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=SEED)
    weights = MasterWeights(model, "fp32")
    optimizer = PlainAdamW(weights, LR, weight_decay)
    for step, tokens in enumerate(batches(spec, 2)):
        weights.zero_grad()
        model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step(LR * (step + 1) / 4)
    return dict(weights.named)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt"])
def test_weight_decay_on_the_flat_buffer_is_torchs_adamw_with_a_no_decay_group(preset):
    spec = load_model(preset)
    table = parameter_table(spec)
    model = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=SEED)
    weights = MasterWeights(model, "fp32")
    reference = reference_adamw(weights.named, table, LR)
    for step, tokens in enumerate(batches(spec, 2)):
        weights.zero_grad()
        model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        for group in reference.param_groups:
            group["lr"] = LR * (step + 1) / 4
        reference.step()
    flat = train_flat(spec, WEIGHT_DECAY)
    assert flat.keys() == table.keys()
    for name, want in weights.named:
        torch.testing.assert_close(flat[name], want, msg=name)
    # the decay did something: without it the matrices end elsewhere
    undecayed = train_flat(spec, 0.0)
    assert not torch.allclose(flat["embed.weight"], undecayed["embed.weight"])


# --- which rank counts which gradient --------------------------------------------------------

PLAIN = {
    "model": "tiny-llama",
    "micro_batch": 1,
    "precision": "fp32",
    "global_batch": 4,
    "pipelines": [
        # TP 2 on the first stage on one vendor, TP 1 on the second on the other
        {"count": 1, "micro_batches": 2, "stages": [stage("nv", 2, 3), stage("amd", 1, 5)]},
        # an unlike replica: the same layers split otherwise, TP the other way round
        {"count": 1, "micro_batches": 2, "stages": [stage("amd", 2, 4), stage("nv", 1, 4)]},
    ],
}
SHARDED = {
    "model": "tiny-llama",
    "micro_batch": 1,
    "precision": "fp32",
    "global_batch": 4,
    "shard_optimizer": True,
    "pipelines": [
        {"count": 2, "micro_batches": 2, "stages": [stage("nv", 2, 5), stage("amd", 1, 3)]}
    ],
}
TIED = {
    "model": "tiny-gpt",
    "micro_batch": 1,
    "precision": "fp32",
    "global_batch": 4,
    "shard_optimizer": True,
    "pipelines": [
        {"count": 2, "micro_batches": 1, "stages": [stage("nv", 2, 4), stage("amd", 1, 4)]},
        {"count": 1, "micro_batches": 2, "stages": [stage("amd", 2, 8)]},
    ],
}


def rank_layout(topology, spec, rank, sharded):
    """The flat layout ``rank``'s engine makes (runtime.engine), without processes."""
    me = topology.ranks[rank]
    table = parameter_table(spec)
    names = sorted(
        name
        for chunk in me.chunks
        for name in stage_parameters(
            spec, chunk.first_layer, chunk.layers, is_first=chunk.is_first, is_last=chunk.is_last
        )
    )
    peers = topology.data_parallel_peers(rank)
    shards = len(peers) if sharded and len(peers) > 1 else 1
    held = rank_buckets(topology, spec, rank, peers_have_a_group=shards > 1)
    shapes = {name: table[name].shard_shape(me.tp) for name in names}
    layout = FlatLayout(shapes, [b.names for b in held], shards)
    return layout, peers.index(rank) if shards > 1 else None


@pytest.mark.parametrize("plan_dict", [PLAIN, SHARDED, TIED], ids=["plain", "sharded", "tied"])
def test_every_gradient_element_is_counted_on_exactly_one_rank(plan_dict):
    spec, plan = load_model(plan_dict["model"]), parse_plan(plan_dict)
    topology = build_topology(plan, CLUSTER)
    table = parameter_table(spec)
    counted = dict.fromkeys(table, 0)  # elements, over every rank
    for rank in range(topology.world_size):
        layout, shard_index = rank_layout(topology, spec, rank, plan.shard_optimizer)
        for start, stop in counted_spans(topology, spec, rank, layout, shard_index):
            for name, (low, high) in layout.spans.items():
                counted[name] += max(0, min(stop, high) - max(start, low))
    assert counted == {name: math.prod(p.shape) for name, p in table.items()}


# --- against the single-process reference, on ranks ------------------------------------------

CLIP = 0.5
SIGN_LIKE_GRAD = 1e-7
"""A clipped gradient past which Adam's first step is insensitive to its rounding (10 eps)."""
RECIPE = SimpleNamespace(
    lr=LR, steps=STEPS, lr_schedule="cosine", warmup_steps=WARMUP, min_lr=LR / 10
)


def reference(preset, global_batch):
    """One process, the whole model: torch's AdamW (no decay on norms and biases), the rate
    warmed up then cosine, clip_grad_norm_. The losses and the norms before clipping of STEPS
    steps; the first step's clipped gradients and the weights it left."""
    spec = load_model(preset)
    table = parameter_table(spec)
    model = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=SEED)
    weights = MasterWeights(model, "fp32")
    optimizer = reference_adamw(weights.named, table, LR)
    params = weights.parameters()
    losses, norms, first = [], [], {}
    for step, tokens in enumerate(batches(spec, global_batch)[:STEPS]):
        weights.zero_grad()
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, RECIPE)
        optimizer.step()
        if step == 0:
            first = {n: (p.grad.clone(), p.detach().clone()) for n, p in weights.named}
    return losses, norms, first


def _rank(rank, world, plans):
    from hethub.runtime.engine import Engine

    out = []
    for plan_dict in plans:
        spec, plan = load_model(plan_dict["model"]), parse_plan(plan_dict)
        topology = build_topology(plan, CLUSTER)
        engine = Engine.for_job(
            plan,
            topology,
            spec,
            CLUSTER,
            seed=SEED,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            clip_grad=CLIP,
        )
        losses, norms, first = [], [], {}
        for step, tokens in enumerate(batches(spec, plan.global_batch)[:STEPS]):
            losses.append(engine.gradients(tokens))
            norms.append(engine.grad_norm)
            engine.update(lr_at(step, RECIPE))
            if step == 0:  # the gradients as the step read them: clipped
                clipped = engine.optimizer.gradients()
                for name, state in engine.optimizer.local_state().items():
                    first[name] = (clipped[name].clone(), state.value.clone())
        me = topology.ranks[rank]
        out.append((losses, norms, first, me.tp_rank, me.tp))
    return out


@pytest.mark.slow
def test_clipping_and_decay_match_the_reference_under_tp_pp_unlike_replicas_and_sharding():
    from hethub.runtime.spawn import run_ranks

    plans = [PLAIN, SHARDED]
    worlds = {build_topology(parse_plan(p), CLUSTER).world_size for p in plans}
    assert worlds == {6}  # one job of 6 ranks runs both
    results = run_ranks(_rank, 6, plans, timeout_s=240, purpose="test")
    ref_losses, ref_norms, ref_first = reference("tiny-llama", 4)
    assert all(norm > 2 * CLIP for norm in ref_norms)  # every step clipped, by half or more
    table = parameter_table(load_model("tiny-llama"))
    for p, plan_dict in enumerate(plans):
        for rank_results in results:
            losses, norms, first, tp_rank, tp = rank_results[p]
            assert norms[0] == pytest.approx(ref_norms[0], rel=1e-6), plan_dict
            assert norms == pytest.approx(ref_norms, rel=1e-5), plan_dict
            assert losses == pytest.approx(ref_losses, rel=1e-5), plan_dict
            assert first.keys() <= table.keys() and first
            for name, (grad, weight) in first.items():
                want_grad, want_weight = (
                    shard(table[name], t, tp_rank, tp) for t in ref_first[name]
                )
                torch.testing.assert_close(grad, want_grad, msg=name)
                # Adam's first step moves a weight by about lr * g / (|g| + eps): by lr, whatever
                # g's rounding, but where g is itself rounding-sized (near eps), where any
                # rounding moves it anywhere within lr. (A token absent from the batch: g = 0,
                # its embedding row only decays.)
                steady = (want_grad.abs() > SIGN_LIKE_GRAD) | (want_grad == 0)
                assert steady.float().mean() > 0.95, name
                torch.testing.assert_close(weight[steady], want_weight[steady], msg=name)
                assert (weight - want_weight).abs().max() <= LR, name


# --- the flags --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--weight-decay", "-0.1"], "--weight-decay = -0.1: must be a finite number of 0 or more"),
        (["--clip-grad", "nan"], "--clip-grad = nan: must be a finite number of 0 or more"),
        (["--min-lr", "inf"], "--min-lr = inf: must be a finite number of 0 or more"),
        (["--warmup-steps", "-1"], "--warmup-steps = -1: must be an integer of 0 or more"),
        (["--eval-every", "0"], "--eval-every = 0: must be a positive integer"),
        (["--seq-len", "0"], "--seq-len = 0: must be a positive integer"),
        (["--lr-schedule", "step"], "argument --lr-schedule: invalid choice: 'step'"),
        (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr = 0.01: above --lr = 0.001"),
        (["--init-from", "no-such-model"], "no-such-model"),
    ],
)
def test_a_bad_recipe_flag_is_one_line_before_any_process_starts(
    capsys, monkeypatch, tmp_path, argv, message
):
    from hethub.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_a_run_json_without_the_recipe_resumes_with_the_recipe_it_trained_with(tmp_path):
    # run.json files written before the recipe's fields: a constant rate, no decay, no clipping
    from hethub.runtime.rundir import DEFAULT_SETTINGS, RunDir

    old = {"seed": 0, "lr": 1e-3, "data": None, "steps": 4, "checkpoint_every": 2}
    (tmp_path / "run.json").write_text(json.dumps({**old, "timeout_s": 60}))
    settings = RunDir(tmp_path).read_settings()
    assert (settings.weight_decay, settings.clip_grad, settings.lr_schedule) == (0, 0, "constant")
    assert [lr_at(s, settings) for s in range(4)] == [1e-3] * 4
    assert settings.eval_data is None and settings.init_from is None and settings.seq_len is None
    # a new run's defaults are the recipe's
    assert (DEFAULT_SETTINGS.weight_decay, DEFAULT_SETTINGS.clip_grad) == (0.1, 1.0)
    assert DEFAULT_SETTINGS.lr_schedule == "cosine"


def test_train_help_names_the_recipe_and_evaluation_flags(capsys):
    from hethub.cli import main

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--weight-decay DECAY",
        "--warmup-steps STEPS",
        "--lr-schedule {cosine,linear,constant}",
        "--min-lr LR",
        "--clip-grad NORM",
        "--init-from DIR",
        "--seq-len L",
        "--eval-data D",
        "--eval-every K",
        "--eval-sequences N",
    ):
        assert flag in out, flag
    assert "5% of the run's steps" in out
