"""Model folders: supported layouts load; anything else fails naming the file and the field."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.errors import ModelLoadError
from services.engine.loader import load_model
from tests.support.reference import greedy, make_engine, random_prompts, run_all


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,fragment", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act"),
    ({"hidden_size": None}, "missing field 'hidden_size'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope_type 'yarn'"),
    ({"model_type": "mistral", "sliding_window": 128}, "sliding_window=128"),
    ({"model_type": "gemma3_text", "hidden_act": None, "final_logit_softcapping": 30.0},
     "final_logit_softcapping=30.0 is not supported"),
    ({"model_type": "gemma3_text", "hidden_act": None, "layer_types": ["full_attention"]},
     "layer_types must name 2 layers"),
    ({"model_type": "gemma3_text", "hidden_act": "silu"}, "unsupported hidden_act 'silu' for gemma3_text"),
])
def test_unsupported_config_names_file_and_field(tiny_model, tmp_path, changes, fragment):
    folder = copy_model(tiny_model, tmp_path / "m")
    edit_config(folder, **changes)
    with pytest.raises(ModelLoadError, match="config.json") as exc:
        load_model(folder)
    assert fragment in str(exc.value)


def test_missing_files(tiny_model, tmp_path):
    folder = copy_model(tiny_model, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(folder)
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load_model(tiny_model, dtype="float16")


def test_missing_tensor_is_named(tiny_model, tmp_path):
    folder = copy_model(tiny_model, tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    from services.engine.models.llama import LlamaModel
    loaded = load_model(folder)
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.down_proj.weight"):
        LlamaModel(loaded.config, loaded.weights)


def test_sharded_checkpoint_gives_the_same_output(tiny_model, tmp_path):
    folder = copy_model(tiny_model, tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, folder / file)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    prompts = random_prompts(4, vocab=4000)
    assert run_all(make_engine(folder), prompts, greedy(8)) == run_all(make_engine(tiny_model), prompts, greedy(8))


def test_bfloat16_loads_and_generates(tiny_model):
    loaded = load_model(tiny_model, dtype="bfloat16")
    assert loaded.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    from services.config.engine import EngineConfig
    from services.engine.engine import LLMEngine
    engine = LLMEngine(EngineConfig(str(tiny_model), dtype="bfloat16"))
    out = run_all(engine, random_prompts(3, vocab=4000), greedy(6))
    assert [len(o) for o in out] == [6, 6, 6]
    assert loaded.eos_token_ids == (2,)
