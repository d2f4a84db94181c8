"""Writes the PEFT fixtures in this folder with the real `peft` library (not run by the tests).

peft needs torch, which rlproxy does not install; this was run once in a throwaway venv:

    python3 -m venv /tmp/peft-venv && /tmp/peft-venv/bin/pip install peft   # torch 2.15, peft 0.21.2
    /tmp/peft-venv/bin/python tests/data/peft/make_fixture.py ~/.cache/rlproxy/models/embedded-tiny-v1

It writes, each from `get_peft_model(...).save_pretrained(...)`:
- qwen3-tiny/: a LoRA (r=4, alpha=10, all seven linear modules, every block) for rlproxy's
  embedded tiny model (qwen3, generator version 1; version 2, embedded-tiny-v2, has the same
  weights and only a longer configured window, so the fixture holds for it), with random non-zero lora_B so that it changes
  the output, in peft's own adapter_model.safetensors + adapter_config.json; and
  expected_logprobs.json: the log-probs torch + peft give for a fixed token sequence with that
  adapter, which rlproxy's `serve --adapter` must reproduce.
- llama-smollm2/: the key names and shapes (layout.json, no weights) and adapter_config.json of a
  LoRA (r=8, alpha=160, all seven linear modules, the last 4 of 30 blocks) on a randomly
  initialised model with SmolLM2-135M's llama config: what rlproxy's PEFT export must match.
"""

import json
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = [1, 5, 200, 31, 700, 12, 999, 3, 64, 128, 400, 2]


def layout(folder: Path) -> dict:
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in sorted(f.keys())}


def qwen3_tiny(embedded: Path) -> None:
    out = HERE / "qwen3-tiny"
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(embedded, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=10, target_modules=MODULES,
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():  # peft starts lora_B at zero: make the adapter do something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(out)
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0, :-1]
    logp = torch.log_softmax(logits.double(), -1)
    picked = logp.gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    (out / "expected_logprobs.json").write_text(json.dumps(
        {"tokens": TOKENS, "logprobs": picked.tolist(), "torch": torch.__version__,
         "peft": __import__("peft").__version__}, indent=1))


def llama_smollm2() -> None:
    out = HERE / "llama-smollm2"
    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         vocab_size=49152, tie_word_embeddings=True)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(
        r=8, lora_alpha=160, target_modules=MODULES, layers_to_transform=[26, 27, 28, 29],
        task_type="CAUSAL_LM"))
    model.peft_config["default"].base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.save_pretrained(out)
    (out / "layout.json").write_text(json.dumps(layout(out), indent=1))
    (out / "adapter_model.safetensors").unlink()  # 4 MB of random numbers: names/shapes suffice


if __name__ == "__main__":
    qwen3_tiny(Path(sys.argv[1]))
    llama_smollm2()
