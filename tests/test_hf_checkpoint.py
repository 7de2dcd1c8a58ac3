"""HuggingFace weights in: tiny Llama (GQA, rope_theta 500000), Qwen2 (q/k/v biases, sharded
files with their index) and GPT-2 (tied head, Conv1D) made by transformers with random weights;
hethub reads each TP slice of them (fused and transposed into its layout) and writes them back
as the same tensors. The mapping is checked in this process; one job of 3 ranks (TP 2 on the nv
stage, TP 1 on the amd one) imports each model, saves it, trains it 2 steps and saves again,
into run folders that tests/test_export.py and tests/test_eval_cli.py read too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hethub.errors import HethubError
from hethub.runtime.hf_checkpoint import HfWeights, export_checkpoint, hf_tensors_of
from hethub.runtime.rundir import RunDir, RunSettings
from hethub.spec import load_model, parse_cluster, parse_plan
from hethub.spec.hf_names import hf_tensors
from hethub.spec.parameters import parameter_table

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 32
KINDS = ("llama", "qwen2", "gpt2")
CLUSTER = parse_cluster(
    {
        "groups": [
            {"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 2},
            {"name": "amd", "accelerator": "mi250x", "nodes": 1, "devices_per_node": 2},
        ]
    },
    "test",
)


def hf_model(kind: str):
    """A tiny transformers model of ``kind``, every weight random (biases and norms too)."""
    torch.manual_seed(KINDS.index(kind))
    common = {"vocab_size": VOCAB, "max_position_embeddings": SEQ}
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        llama_like = {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            **common,
        }
        if kind == "llama":
            config = transformers.LlamaConfig(rope_theta=500000.0, **llama_like)
            model = transformers.LlamaForCausalLM(config)
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama_like))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    return model.eval()


def write_hf(kind: str, folder: Path) -> Path:
    """The model of ``kind`` saved by transformers in ``folder`` (Qwen2's in several shards
    with their index); its folder."""
    shards = {"max_shard_size": "40KB"} if kind == "qwen2" else {}
    hf_model(kind).save_pretrained(folder, **shards)
    return folder


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files."""
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, framework="pt") as file:
            out.update({name: file.get_tensor(name) for name in file.keys()})  # noqa: SIM118
    return out


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: write_hf(kind, root / kind) for kind in KINDS}


def test_the_mapping_reads_every_slice_and_writes_back_the_same_tensors(hf_folders):
    assert len(list(hf_folders["qwen2"].glob("model-*.safetensors"))) > 1  # the index's way
    for kind, folder in hf_folders.items():
        spec = load_model(folder)
        weights = HfWeights(folder, spec)
        written = {}
        for name, param in parameter_table(spec).items():
            full = weights.parameter(name)
            assert tuple(full.shape) == param.shape and full.dtype == torch.float32, name
            if param.tp_dim is not None:  # TP 2's slices are the full tensor's halves
                halves = [weights.parameter(name, rank, 2) for rank in range(2)]
                assert torch.equal(torch.cat(halves, param.tp_dim), full), name
            written.update(hf_tensors_of(spec, name, full))
        stored = file_tensors(folder)
        if spec.tied_head:
            stored.pop("lm_head.weight", None)
        assert sorted(written) == sorted(stored) == sorted(hf_tensors(spec)), kind
        for name, tensor in stored.items():
            assert torch.equal(written[name], tensor), name


def test_fused_and_transposed_layouts_are_hethubs(hf_folders):
    """qkv holds each KV head's query heads, then its key and value (Qwen2's biases alike);
    GPT-2's c_attn is [in, out] on file, its thirds q, k, v."""
    stored = file_tensors(hf_folders["qwen2"])
    spec = load_model(hf_folders["qwen2"])
    qkv = HfWeights(hf_folders["qwen2"], spec).parameter("layers.1.qkv.bias")  # [kv, 2 + 2, d]
    at = "model.layers.1.self_attn"
    assert torch.equal(qkv[1, :2].flatten(), stored[f"{at}.q_proj.bias"][32:])  # heads 2, 3
    assert torch.equal(qkv[1, 2], stored[f"{at}.k_proj.bias"][16:])
    assert torch.equal(qkv[0, 3], stored[f"{at}.v_proj.bias"][:16])
    gpt = load_model(hf_folders["gpt2"])
    c_attn = file_tensors(hf_folders["gpt2"])["transformer.h.0.attn.c_attn.weight"]  # [h, 3h]
    qkv = HfWeights(hf_folders["gpt2"], gpt).parameter("layers.0.qkv.weight")  # [4, 3, 16, h]
    assert torch.equal(qkv[2, 1], c_attn[:, 64 + 32 : 64 + 48].t())  # head 2's key


def _altered(source: Path, target: Path, change) -> Path:
    """A copy of the one-file HF folder ``source`` whose tensors ``change`` edits in place."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = file_tensors(source)
    change(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_weights_that_disagree_with_the_config_are_one_line_naming_the_tensor(hf_folders, tmp_path):
    llama = hf_folders["llama"]
    spec = load_model(llama)
    name = "model.layers.1.mlp.up_proj.weight"
    missing = _altered(llama, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(HethubError, match=f"^{missing}: the weights have no {name}, which"):
        HfWeights(missing, spec)
    extra = _altered(llama, tmp_path / "extra", lambda t: t.update(extra=torch.zeros(2)))
    with pytest.raises(HethubError, match=f"^{extra}: the weights hold extra, which the model"):
        HfWeights(extra, spec)
    wrong = _altered(llama, tmp_path / "wrong", lambda t: t.update({name: torch.zeros(96, 32)}))
    with pytest.raises(HethubError) as refused:
        HfWeights(wrong, spec).parameter("layers.1.gate_up.weight")
    assert str(refused.value) == (
        f"{wrong}: {name} has shape [96, 32] in the weights, the model's config needs [96, 64]"
    )
    with pytest.raises(HethubError, match="no model.safetensors nor model.safetensors.index"):
        HfWeights(tmp_path, spec)
    # GPT-2's causal-mask buffers (older transformers saved them) are no weights: skipped;
    # so is a copy of a tied head. The base model's names without its prefix are read too.
    gpt = hf_folders["gpt2"]

    def as_gpt2_on_the_hub(tensors):
        for key in list(tensors):
            tensors[key.removeprefix("transformer.")] = tensors.pop(key)
        tensors["h.0.attn.bias"] = torch.ones(1, 1, SEQ, SEQ)
        tensors["lm_head.weight"] = tensors["wte.weight"].clone()

    hub = _altered(gpt, tmp_path / "hub", as_gpt2_on_the_hub)
    spec = load_model(gpt)
    assert torch.equal(
        HfWeights(hub, spec).parameter("embed.weight"),
        HfWeights(gpt, spec).parameter("embed.weight"),
    )


# ---- one job: import under TP 2 (nv) + TP 1 (amd), save, train, save -------------------------


def plan_dict(folder: Path) -> dict:
    return {
        "model": str(folder),
        "micro_batch": 1,
        "global_batch": 2,
        "precision": "fp32",
        "pipelines": [
            {
                "count": 1,
                "micro_batches": 2,
                "stages": [
                    {"group": "nv", "tp": 2, "layers": 1},
                    {"group": "amd", "tp": 1, "layers": 1},
                ],
            }
        ],
    }


def _import_and_train(rank, world, runs, bad):
    """Each run: its engine starts from its HF folder (after a refused load of ``bad``), saves
    step 0, trains 2 steps, saves step 2; what this rank held right after the import."""
    from hethub.runtime.checkpoint import save_checkpoint
    from hethub.runtime.engine import Engine
    from hethub.runtime.hf_checkpoint import load_hf_weights
    from hethub.spec.topology import build_topology

    torch.set_num_threads(1)
    out = []
    for run_dir, folder in runs:
        spec, plan = load_model(folder), parse_plan(plan_dict(folder))
        topology = build_topology(plan, CLUSTER)
        engine = Engine.for_job(plan, topology, spec, CLUSTER, seed=3, lr=1e-2)
        refused = None
        try:
            load_hf_weights(engine, Path(bad))
        except HethubError as error:
            refused = str(error)
        load_hf_weights(engine, Path(folder))
        me = topology.ranks[rank]
        held = {n: [t.clone() for t in s] for n, s in engine.optimizer.local_state().items()}
        checkpoints = RunDir(run_dir).checkpoints
        save_checkpoint(engine, checkpoints, 0, {"plan": "import"})
        gen = torch.Generator().manual_seed(5)
        losses = [
            engine.step(torch.randint(0, VOCAB, (2, spec.seq_len + 1), generator=gen))
            for _ in range(2)
        ]
        save_checkpoint(engine, checkpoints, 2, {"plan": "import"})
        out.append({"me": (me.tp_rank, me.tp), "held": held, "refused": refused, "losses": losses})
    return out


def make_run_dir(path: Path, folder: Path, data: Path) -> Path:
    """A run folder as hethub train writes it, for the model of the HF ``folder``."""
    run = RunDir(path)
    path.mkdir(parents=True)
    settings = RunSettings(
        seed=3, lr=1e-2, data=str(data), steps=2, checkpoint_every=2, timeout_s=60.0
    )
    run.write_settings(settings)
    run.write_text(run.plan, parse_plan(plan_dict(folder)).to_yaml())
    return path


TEXT = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times." for i in range(60)
)


@pytest.fixture(scope="session")
def imported_runs(hf_folders, tmp_path_factory):
    """Per kind: its run folder (checkpoints of step 0, the import, and step 2), and every
    rank's results; the text data the tests evaluate on."""
    from hethub.runtime.spawn import run_ranks

    root = tmp_path_factory.mktemp("runs")
    data = root / "eval.txt"
    data.write_text(TEXT)
    bad = _altered(
        hf_folders["llama"],
        root / "bad",
        lambda t: t.update({"model.norm.weight": torch.ones(3)}),
    )
    runs = [
        (str(make_run_dir(root / kind, hf_folders[kind], data)), str(hf_folders[kind]))
        for kind in KINDS
    ]
    ranks = run_ranks(_import_and_train, 3, runs, str(bad), timeout_s=240, purpose="test")
    return {
        "data": data,
        "bad": bad,
        **{
            kind: {"run": Path(runs[i][0]), "ranks": [r[i] for r in ranks]}
            for i, kind in enumerate(KINDS)
        },
    }


@pytest.mark.slow
def test_each_rank_starts_from_its_slice_of_the_hf_weights(imported_runs, hf_folders):
    for kind in KINDS:
        spec = load_model(hf_folders[kind])
        weights = HfWeights(hf_folders[kind], spec)
        for rank in imported_runs[kind]["ranks"]:
            tp_rank, tp = rank["me"]
            for name, (value, exp_avg, exp_avg_sq, step) in rank["held"].items():
                assert torch.equal(value, weights.parameter(name, tp_rank, tp)), (kind, name)
                assert not exp_avg.any() and not exp_avg_sq.any() and step.item() == 0
            assert all(math.isfinite(loss) for loss in rank["losses"])  # it trained on


@pytest.mark.slow
def test_import_then_export_gives_back_every_tensor(imported_runs, hf_folders, tmp_path):
    """Through DCP's sharded checkpoint of the TP 2 + TP 1 plan and back, in fp32."""
    for kind in KINDS:
        spec = load_model(hf_folders[kind])
        out = tmp_path / kind
        out.mkdir()
        step0 = imported_runs[kind]["run"] / "checkpoints" / "step-000000"
        export_checkpoint(step0, spec, out, torch.float32, max_shard_bytes=50_000)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1  # several shards, each named
        got, want = file_tensors(out), file_tensors(hf_folders[kind])
        want.pop("lm_head.weight", None) if spec.tied_head else None
        assert sorted(got) == sorted(want) == sorted(index["weight_map"]), kind
        for name, tensor in want.items():
            assert got[name].shape == tensor.shape and torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_a_disagreeing_folder_is_refused_on_every_rank_in_one_line(imported_runs):
    bad = imported_runs["bad"]
    said = f"{bad}: model.norm.weight has shape [3] in the weights, the model's config needs [64]"
    # the last stage reads the final norm; every rank says its problem
    assert {rank["refused"] for rank in imported_runs["llama"]["ranks"]} == {said}
