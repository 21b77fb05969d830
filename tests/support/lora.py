"""LoRA adapters made with PEFT (the outside reference) on a seeded transformers model, and PEFT's greedy output."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.reference import Reference, tie_gap

# Four adapters of different ranks and target sets (one rslora): what the mixed-batch tests load.
ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "attn4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp16": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "all32": dict(r=32, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                        "down_proj"]),
}


def save_peft_adapter(base_dir: Path, out: Path, seed: int, **lora) -> Path:
    """A PEFT LoRA adapter of the base model with random A and B (init_lora_weights=False: B is not zero),
    saved as PEFT saves it (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():  # large enough deltas that every adapter changes the greedy output
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list, max_new: int) -> list[Reference]:
    """transformers + PEFT generate with one adapter (or none), one request at a time, greedy, EOS ignored."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager", dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    refs = []
    for p in prompts:
        out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
        tops = [s[0].float().topk(2).values for s in out.scores]
        refs.append(Reference(out.sequences[0, len(p):].tolist(), [float(t[0] - t[1]) for t in tops],
                              [tie_gap(float(t[0]), torch.float32) for t in tops]))
    return refs
