"""HuggingFace models as hethub models: a tiny random Llama (GQA, rope_theta 500000, Llama 3.1's
rope scaling, tied and untied), Qwen2 (q/k/v biases), Mistral and GPT-2 (tied, Conv1D layout,
gelu_new) made with transformers' own config classes and weights. hethub's model of the same
config.json, holding the same weights, computes transformers' loss in fp32; configs hethub does
not run are refused in one line; the predictor prices a model named by its config.json."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from torch.nn import functional as F

from hethub.errors import HethubError, SpecError
from hethub.predictor import predict
from hethub.profiles.types import LayerKey
from hethub.runtime.model import Stage, fuse, rotary_inverse_frequencies
from hethub.spec import check_plan, load_model, parse_cluster, parse_plan
from hethub.spec.hf_config import hf_config_from_model, model_from_hf_config
from hethub.spec.model import ModelSpec, model_file_fields, parse_model
from hethub.spec.parameters import fused_parts, parameter_count, parameter_table
from tests import test_engine

SEQ_LEN = 24
TINY_LLAMA = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # wavelengths below 16, between 16 and 64, and above: each of the scaling's three rules
    "original_max_position_embeddings": 64,
}
TINY_GPT2 = {
    "vocab_size": 96,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 48,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def hf_config(kind: str, **fields) -> transformers.PretrainedConfig:
    configs = {
        "llama": (transformers.LlamaConfig, "LlamaForCausalLM", TINY_LLAMA),
        "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM", TINY_LLAMA),
        "mistral": (transformers.MistralConfig, "MistralForCausalLM", TINY_LLAMA),
        "gpt2": (transformers.GPT2Config, "GPT2LMHeadModel", TINY_GPT2),
    }
    cls, architecture, base = configs[kind]
    # a copy: transformers writes rope_theta into the rope_scaling dict it is given
    return cls(architectures=[architecture], **copy.deepcopy({**base, **fields}))


def random_hf_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """transformers' model of ``config`` with every weight random (biases and norms too: their
    initial zeros and ones would hide a mix-up), in fp32, in eval mode (no dropout)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return model


def hethub_state(spec: ModelSpec, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hethub's full-model tensors (spec.parameters' names) from a transformers state dict: the
    mapping the checkpoint reader implements, written out here for the test."""
    if spec.arch == "gpt":
        return _gpt2_state(spec, hf)
    state = {"embed.weight": hf.pop("model.embed_tokens.weight")}
    parts = fused_parts(spec)
    for i in range(spec.layers):
        hf_layer, ours = f"model.layers.{i}", f"layers.{i}"
        attention = f"{hf_layer}.self_attn"
        state[f"{ours}.norm1.weight"] = hf.pop(f"{hf_layer}.input_layernorm.weight")
        state[f"{ours}.norm2.weight"] = hf.pop(f"{hf_layer}.post_attention_layernorm.weight")
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            qkv = [hf.pop(f"{attention}.{p}_proj.{kind}") for p in "qkv"]
            state[f"{ours}.qkv.{kind}"] = fuse(parts[f"qkv.{kind}"], qkv)
        state[f"{ours}.o.weight"] = hf.pop(f"{attention}.o_proj.weight")
        if spec.o_bias:
            state[f"{ours}.o.bias"] = hf.pop(f"{attention}.o_proj.bias")
        gate_up = [hf.pop(f"{hf_layer}.mlp.{p}_proj.weight") for p in ("gate", "up")]
        state[f"{ours}.gate_up.weight"] = fuse(parts["gate_up.weight"], gate_up)
        state[f"{ours}.down.weight"] = hf.pop(f"{hf_layer}.mlp.down_proj.weight")
    state["final_norm.weight"] = hf.pop("model.norm.weight")
    head = hf.pop("lm_head.weight")
    if not spec.tied_head:
        state["head.weight"] = head
    assert not hf, f"not mapped: {sorted(hf)}"
    return state


def _gpt2_state(spec: ModelSpec, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's Conv1D weights are (in, out): hethub's linears are (out, in), so each is
    transposed; c_attn's output features are q | k | v, each heads x head_dim."""
    state = {"embed.weight": hf.pop("transformer.wte.weight")}
    state["pos.weight"] = hf.pop("transformer.wpe.weight")
    parts = fused_parts(spec)
    h = spec.hidden
    for i in range(spec.layers):
        block, ours = f"transformer.h.{i}", f"layers.{i}"
        for norm, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            for kind in ("weight", "bias"):
                state[f"{ours}.{norm}.{kind}"] = hf.pop(f"{block}.{theirs}.{kind}")
        weight = hf.pop(f"{block}.attn.c_attn.weight").t()  # (3h, h)
        bias = hf.pop(f"{block}.attn.c_attn.bias")  # (3h,)
        state[f"{ours}.qkv.weight"] = fuse(parts["qkv.weight"], list(weight.split(h)))
        state[f"{ours}.qkv.bias"] = fuse(parts["qkv.bias"], list(bias.split(h)))
        for ours_name, theirs in (("o", "attn.c_proj"), ("fc1", "mlp.c_fc"), ("fc2", "mlp.c_proj")):
            state[f"{ours}.{ours_name}.weight"] = hf.pop(f"{block}.{theirs}.weight").t()
            state[f"{ours}.{ours_name}.bias"] = hf.pop(f"{block}.{theirs}.bias")
    state["final_norm.weight"] = hf.pop("transformer.ln_f.weight")
    state["final_norm.bias"] = hf.pop("transformer.ln_f.bias")
    head = hf.pop("lm_head.weight")
    if not spec.tied_head:
        state["head.weight"] = head
    assert not hf, f"not mapped: {sorted(hf)}"
    return state


def saved(config: transformers.PretrainedConfig, folder: Path) -> Path:
    config.save_pretrained(folder)
    return folder


def losses(config: transformers.PretrainedConfig, folder: Path) -> tuple[float, float, ModelSpec]:
    """transformers' and hethub's mean next-token loss on the same tokens, and hethub's spec
    of the saved config.json."""
    hf_model = random_hf_model(config)
    spec = load_model(saved(config, folder), seq_len=SEQ_LEN)
    tokens = torch.randint(
        0, spec.vocab, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        logits = hf_model(input_ids=tokens[:, :-1]).logits
        theirs = F.cross_entropy(logits.reshape(-1, spec.vocab), tokens[:, 1:].reshape(-1))
        state = hethub_state(spec, {k: v.clone() for k, v in hf_model.state_dict().items()})
        assert state.keys() == parameter_table(spec).keys()
        stage = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=0)
        stage.load_full(state)
        ours = stage.loss(stage(tokens[:, :-1]), tokens[:, 1:])
    return float(theirs), float(ours), spec


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}),
        ("llama", {"rope_theta": 500000.0, "tie_word_embeddings": True}),
        ("llama", {"attention_bias": True}),
        ("qwen2", {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
        ("mistral", {"sliding_window": 4096}),
        ("gpt2", {}),
        ("gpt2", {"activation_function": "gelu", "tie_word_embeddings": False}),
    ],
    ids=["llama3.1", "llama3.2-tied", "llama-bias", "qwen2", "mistral", "gpt2", "gpt2-gelu"],
)
def test_hethub_computes_transformers_loss_from_the_same_config_and_weights(tmp_path, kind, fields):
    theirs, ours, spec = losses(hf_config(kind, **fields), tmp_path)
    assert abs(theirs - ours) < 1e-5, (theirs, ours)
    # the model file of a run folder holds every field: read back, the same model
    assert parse_model(model_file_fields(spec), "model.yaml", spec.name) == spec


def test_the_rotary_frequencies_are_transformers_llama3_ones_to_the_bit():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config("llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    spec = model_from_hf_config(config.to_dict(), "config.json", SEQ_LEN)
    assert spec.rope_scaling is not None and spec.rope_theta == 500000.0
    ours = rotary_inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, rotary_inverse_frequencies(spec.head_dim, spec.rope_theta))


def test_the_legacy_rope_fields_read_as_transformers_v5_s():
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        **TINY_LLAMA,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_SCALING, "rope_type": None, "type": "llama3"},
    }
    v5 = hf_config("llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING).to_dict()
    assert model_from_hf_config(legacy, "a", 32) == model_from_hf_config(v5, "a", 32)


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("gpt2", {}),
    ],
    ids=["llama3.1", "qwen2", "gpt2"],
)
def test_an_exported_config_is_the_same_model_to_transformers_and_to_hethub(tmp_path, kind, fields):
    spec = model_from_hf_config(hf_config(kind, **fields).to_dict(), "config.json", SEQ_LEN)
    json_file(tmp_path, hf_config_from_model(spec))
    again = transformers.AutoConfig.from_pretrained(tmp_path)
    assert model_from_hf_config(again.to_dict(), "config.json", SEQ_LEN) == spec
    assert load_model(tmp_path, seq_len=SEQ_LEN) == dataclasses.replace(spec, name=tmp_path.name)
    # hethub's own models export too: a Llama preset as LlamaForCausalLM, a GPT as GPT-2
    for preset in ("tiny-llama", "tiny-gpt"):
        model = load_model(preset)
        config = hf_config_from_model(model)
        back = model_from_hf_config(config, preset, model.seq_len)
        assert back.hidden == model.hidden and back.tied_head == model.tied_head
        assert parameter_count(back) == parameter_count(model)


def refusal(config: dict, seq_len: int | None = SEQ_LEN) -> str:
    with pytest.raises(SpecError) as caught:
        model_from_hf_config(config, "config.json", seq_len)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_what_hethub_does_not_run_is_refused_in_one_line_naming_the_field():
    llama = hf_config("llama").to_dict()
    mistral = hf_config("mistral", sliding_window=16).to_dict()
    assert "sliding_window = 16" in refusal(mistral)
    assert model_from_hf_config(mistral, "config.json", 16).seq_len == 16  # the window covers it
    yarn = {**llama, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    assert "rope_parameters.rope_type = 'yarn'" in refusal(yarn)
    unknown = {**llama, "architectures": ["FalconForCausalLM"]}
    assert "architectures = 'FalconForCausalLM'" in refusal(unknown)
    assert "hidden_act = 'gelu'" in refusal({**llama, "hidden_act": "gelu"})
    assert "mlp_bias = True" in refusal({**llama, "mlp_bias": True})
    assert "head_dim = 32" in refusal({**llama, "head_dim": 32})
    qwen2 = hf_config("qwen2").to_dict()
    assert "use_sliding_window = True" in refusal({**qwen2, "use_sliding_window": True})
    gpt2 = hf_config("gpt2").to_dict()
    assert "reorder_and_upcast_attn = True" in refusal({**gpt2, "reorder_and_upcast_attn": True})
    assert "scale_attn_by_inverse_layer_idx" in refusal(
        {**gpt2, "scale_attn_by_inverse_layer_idx": True}
    )
    assert "activation_function = 'relu'" in refusal({**gpt2, "activation_function": "relu"})
    assert "seq_len = 256: must be at most the model's max_position_embeddings (128)" in (
        refusal(llama, 256)
    )


def test_the_sequence_length_defaults_to_the_model_s_capped_at_4096(tmp_path):
    short = hf_config("llama").to_dict()
    assert model_from_hf_config(short, "c", None).seq_len == 128
    long = {**short, "max_position_embeddings": 131072}
    assert model_from_hf_config(long, "c", None).seq_len == 4096
    assert model_from_hf_config(long, "c", 8192).seq_len == 8192
    # a config.json's path works as its folder does; a folder without one says so
    saved(hf_config("gpt2"), tmp_path / "gpt2")
    by_file = load_model(tmp_path / "gpt2" / "config.json")
    assert by_file == load_model(tmp_path / "gpt2") and by_file.name == "gpt2"
    assert by_file.seq_len == 48 and by_file.activation == "gelu_tanh"
    (tmp_path / "empty").mkdir()
    with pytest.raises(HethubError, match="is a directory without a config.json"):
        load_model(tmp_path / "empty")


def test_real_configs_count_their_published_parameters():
    """Llama 3.1 8B, Qwen2.5 0.5B (q/k/v biases, tied) and GPT-2 (1024 learned positions, tied)
    from their config.json fields: hethub counts each model's published parameters."""
    llama31_8b = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_SCALING, "original_max_position_embeddings": 8192},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    qwen25_05b = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    }
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 50257, "n_positions": 1024}
    gpt2 |= {"n_embd": 768, "n_layer": 12, "n_head": 12}
    for config, published in ((llama31_8b, 8_030_261_248), (qwen25_05b, 494_032_768)):
        assert parameter_count(model_from_hf_config(config, "c")) == published
    assert parameter_count(model_from_hf_config(gpt2, "c")) == 124_439_808


def test_the_predictor_prices_a_model_named_by_its_config_json(tmp_path):
    config = hf_config("qwen2", tie_word_embeddings=True)
    folder = saved(config, tmp_path / "qwen2")
    plan = parse_plan(
        {
            "model": str(folder),
            "global_batch": 8,
            "micro_batch": 2,
            "pipelines": [{"count": 1, "stages": [{"group": "cpu", "tp": 2, "layers": 2}]}],
        }
    )
    cluster = parse_cluster(
        {"groups": [{"name": "cpu", "accelerator": "cpu", "nodes": 1, "devices_per_node": 2}]}
    )
    model = load_model(plan.model, seq_len=SEQ_LEN)
    unbiased = load_model(
        json_file(tmp_path, {**config.to_dict(), "architectures": ["LlamaForCausalLM"]}),
        seq_len=SEQ_LEN,
    )
    priced, plain = predict(plan, cluster, model), predict(plan, cluster, unbiased)
    assert priced.fits
    # the biases are priced: their memory and the GEMMs that add them
    assert priced.peak_memory_gb > plain.peak_memory_gb
    assert priced.iteration_time_s > plain.iteration_time_s


def json_file(folder: Path, config: dict) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
def test_a_tied_biased_llama_trains_as_the_single_process_reference_across_vendors(tmp_path):
    """A Qwen2 with its head tied to the embedding (as Llama 3.2's and small Qwen2's are) over two
    stages on two vendors, TP 2 on the first: the last stage's copy of the embedding, the q/k/v
    biases split over TP, every gradient and loss as one process computes them."""
    config = hf_config(
        "qwen2", tie_word_embeddings=True, num_hidden_layers=4, max_position_embeddings=32
    )
    folder = str(saved(config, tmp_path / "qwen2-tied"))
    stages = [test_engine.stage("nv", 2, 2), test_engine.stage("amd", 1, 2)]
    plan = {"global_batch": 2, "pipelines": [{"count": 1, "micro_batches": 2, "stages": stages}]}
    test_engine.PLANS["tied qwen2"] = (folder, plan)
    try:
        test_engine.check_against_reference("tied qwen2", test_engine.BUCKET_BYTES)
    finally:
        del test_engine.PLANS["tied qwen2"]


def test_a_profile_of_one_layer_never_prices_another():
    """Qwen2's layer (q/k/v biases) and GPT-2's (tanh GELU) are keyed apart from hethub's own
    Llama and GPT layers, whose keys and files stay as they were."""
    qwen2 = model_from_hf_config(hf_config("qwen2").to_dict(), "c", SEQ_LEN)
    plain = dataclasses.replace(qwen2, qkv_bias=False, hf_architecture=None)
    gpt2 = model_from_hf_config(hf_config("gpt2").to_dict(), "c", SEQ_LEN)
    conditions = {"device": "cpu", "dtype": "fp32", "threads": 1, "concurrent_ranks": 1}
    keys = [LayerKey.of(m, tp=1, micro_batch=1, **conditions) for m in (qwen2, plain, gpt2)]
    assert [key.variant for key in keys] == ["qkv-bias", "", "gelu-tanh"]
    assert keys[0] != keys[1]
    assert keys[0].file_name().startswith("layer-cpu-llama-qkv-bias-h64-")
    assert keys[1].file_name().startswith("layer-cpu-llama-h64-")


def test_tensor_parallelism_must_split_the_vocabulary_evenly():
    gpt2 = model_from_hf_config({**hf_config("gpt2").to_dict(), "vocab_size": 97}, "c", SEQ_LEN)
    plan = parse_plan(
        {
            "model": "gpt2",
            "global_batch": 2,
            "pipelines": [{"count": 1, "stages": [{"group": "cpu", "tp": 2, "layers": 2}]}],
        }
    )
    cluster = parse_cluster(
        {"groups": [{"name": "cpu", "accelerator": "cpu", "nodes": 1, "devices_per_node": 2}]}
    )
    with pytest.raises(SpecError, match=r"tp = 2: must divide the model's vocab \(97\)"):
        check_plan(plan, cluster, gpt2, "plan.yaml")


def test_a_model_file_holds_the_new_fields_and_refuses_them_where_they_mean_nothing():
    llama31 = {
        "arch": "llama",
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 128,
        "seq_len": 32,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "norm_eps": 1.0e-6,
        "tie_word_embeddings": True,
        "max_position_embeddings": 128,
        "hf_architecture": "LlamaForCausalLM",
    }
    model = parse_model(llama31, "m.yaml", "m")
    assert model.rope_scaling.factor == 8.0 and model.tied_head and not model.qkv_bias
    assert parse_model(model_file_fields(model), "m.yaml", "m") == model
    # a preset's file is as before: its dimensions only
    assert set(model_file_fields(load_model("tiny-gpt"))) == {
        "arch",
        "hidden",
        "layers",
        "heads",
        "kv_heads",
        "ffn_hidden",
        "vocab",
        "seq_len",
    }
    for broken, message in (
        ({"norm_eps": "1e-6"}, "norm_eps = '1e-6': must be a positive number (YAML reads 1e-6"),
        ({"seq_len": 256}, "seq_len = 256: must be at most max_position_embeddings (128)"),
        ({"rope_scaling": {"type": "yarn"}}, "rope_scaling.type = 'yarn': must be one of llama3"),
        ({"activation": "gelu"}, "activation = 'gelu': must be one of swiglu"),
        ({"hf_architecture": "GPT2LMHeadModel"}, "hf_architecture = 'GPT2LMHeadModel': arch llama"),
    ):
        with pytest.raises(SpecError, match=re.escape(message)):
            parse_model({**llama31, **broken}, "m.yaml", "m")
    gpt = {"arch": "gpt", "hidden": 64, "layers": 2, "heads": 4, "vocab": 96, "seq_len": 32}
    with pytest.raises(SpecError, match="rope_theta = 500000.0: gpt has learned positions"):
        parse_model({**gpt, "rope_theta": 500000.0}, "m.yaml", "m")
